//! Naming an RBD image: `rbd:POOL/[NAMESPACE/]IMAGE[@SNAPSHOT][:KEY=VALUE]...`, as qemu spells
//! it. A backslash makes the next character literal (`\:`, `\@`, `\/`, `\\`). Keys: `conf` (a
//! Ceph configuration file), `id` (the client name without `client.`), `keyring`; any other key
//! is a Ceph option handed to librados as it is (`mon_host=127.0.0.1:3300`), as qemu does.
//! Parsed once here into [`RbdSpec`]; nothing else reads the string.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use ucrypt::{Error, Result};

/// The prefix that names an RBD image rather than a path.
pub const RBD_PREFIX: &str = "rbd:";
/// How long a request (or connecting) may wait for the cluster before it fails, unless
/// [`RbdOptions::remote_timeout`] says otherwise.
pub const REMOTE_TIMEOUT_DEFAULT: Duration = Duration::from_secs(30);
/// Ceph options given in a spec at most: a spec is typed by a person, and a bound keeps a
/// pasted megabyte of `:a=b` from turning into as many librados calls.
pub const SETTINGS_MAX: usize = 64;

/// How to reach the cluster. `Default`: librados finds the configuration itself (`$CEPH_CONF`,
/// then `/etc/ceph/ceph.conf`, ...), as client `admin`, read-write, [`REMOTE_TIMEOUT_DEFAULT`].
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RbdOptions {
    /// A Ceph configuration file; `None`: `$CEPH_CONF` or librados' default places.
    pub conf: Option<PathBuf>,
    /// The client name without `client.` (`admin` when `None`).
    pub id: Option<String>,
    /// A keyring file; `None`: what the configuration says.
    pub keyring: Option<PathBuf>,
    /// Further Ceph options, set in this order after the configuration file is read.
    pub settings: Vec<(String, String)>,
    /// How long a request, or connecting, may wait for the monitors and OSDs before it fails
    /// with an I/O error: librados' `rados_osd_op_timeout`, `rados_mon_op_timeout` and
    /// `client_mount_timeout`, in whole seconds (rounded up). At least one second.
    pub remote_timeout: Duration,
    /// Open the image read-only (a snapshot always is).
    pub read_only: bool,
}

impl Default for RbdOptions {
    fn default() -> Self {
        RbdOptions {
            conf: None,
            id: None,
            keyring: None,
            settings: Vec::new(),
            remote_timeout: REMOTE_TIMEOUT_DEFAULT,
            read_only: false,
        }
    }
}

/// An RBD image, and how to reach its cluster.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RbdSpec {
    pub pool: String,
    /// A RADOS namespace inside the pool (`rbd:pool/ns/image`).
    pub namespace: Option<String>,
    pub image: String,
    /// A snapshot, opened read-only.
    pub snapshot: Option<String>,
    /// From the spec's `:key=value` suffix; a caller may override them (command-line options).
    pub options: RbdOptions,
}

impl RbdSpec {
    /// An image with default options.
    pub fn new(pool: impl Into<String>, image: impl Into<String>) -> RbdSpec {
        RbdSpec {
            pool: pool.into(),
            namespace: None,
            image: image.into(),
            snapshot: None,
            options: RbdOptions::default(),
        }
    }

    /// Whether `name` names an RBD image (starts with `rbd:`) rather than a path.
    pub fn is_rbd(name: &str) -> bool {
        name.starts_with(RBD_PREFIX)
    }

    /// Parses `rbd:POOL/[NAMESPACE/]IMAGE[@SNAPSHOT][:KEY=VALUE]...`.
    pub fn parse(name: &str) -> Result<RbdSpec> {
        let bad = |why: &str| Error::InvalidArgument(format!("rbd image name '{name}': {why}"));
        let rest = name
            .strip_prefix(RBD_PREFIX)
            .ok_or_else(|| bad("does not start with 'rbd:'"))?;
        let mut segments = split_unescaped(rest, ':').into_iter();
        let path = segments.next().unwrap_or_default();
        let (path, snapshot) = match split_unescaped(path, '@').as_slice() {
            [p] => (*p, None),
            [p, s] => (
                *p,
                Some(nonempty(s, "the snapshot name after '@'").map_err(|e| bad(&e))?),
            ),
            _ => return Err(bad("more than one '@'")),
        };
        let parts = split_unescaped(path, '/');
        let (pool, namespace, image) = match parts.as_slice() {
            [p, i] => (p, None, i),
            [p, n, i] => (p, Some(n), i),
            _ => return Err(bad("expected POOL/IMAGE or POOL/NAMESPACE/IMAGE")),
        };
        let mut spec = RbdSpec {
            pool: nonempty(pool, "the pool name").map_err(|e| bad(&e))?,
            namespace: namespace
                .map(|n| nonempty(n, "the namespace"))
                .transpose()
                .map_err(|e| bad(&e))?,
            image: nonempty(image, "the image name").map_err(|e| bad(&e))?,
            snapshot,
            options: RbdOptions::default(),
        };
        let o = &mut spec.options;
        for seg in segments {
            let (key, value) = seg
                .split_once('=')
                .ok_or_else(|| bad(&format!("option '{seg}' is not KEY=VALUE")))?;
            let (key, value) = (unescape(key), unescape(value));
            if key.is_empty() {
                return Err(bad(&format!("option '{seg}' has no key")));
            }
            let once = |set: bool| {
                if set {
                    Err(bad(&format!("option '{key}' given twice")))
                } else {
                    Ok(())
                }
            };
            match key.as_str() {
                "conf" => {
                    once(o.conf.is_some())?;
                    o.conf = Some(PathBuf::from(value));
                }
                "id" => {
                    once(o.id.is_some())?;
                    o.id = Some(value);
                }
                "keyring" => {
                    once(o.keyring.is_some())?;
                    o.keyring = Some(PathBuf::from(value));
                }
                _ => {
                    if o.settings.len() == SETTINGS_MAX {
                        return Err(bad(&format!("more than {SETTINGS_MAX} Ceph options")));
                    }
                    o.settings.push((key, value));
                }
            }
        }
        Ok(spec)
    }

    /// `pool/[namespace/]image[@snapshot]`, as the `rbd` command spells it.
    pub fn image_path(&self) -> String {
        let mut s = self.pool.clone();
        if let Some(ns) = &self.namespace {
            s = format!("{s}/{ns}");
        }
        s = format!("{s}/{}", self.image);
        if let Some(snap) = &self.snapshot {
            s = format!("{s}@{snap}");
        }
        s
    }
}

/// `rbd:` and the image path, without the options (which may name files but hold no secret;
/// they are left out to keep messages short).
impl fmt::Display for RbdSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let esc = |s: &str| {
            let mut o = String::with_capacity(s.len());
            for c in s.chars() {
                if matches!(c, ':' | '@' | '/' | '\\') {
                    o.push('\\');
                }
                o.push(c);
            }
            o
        };
        write!(f, "{RBD_PREFIX}{}", esc(&self.pool))?;
        if let Some(ns) = &self.namespace {
            write!(f, "/{}", esc(ns))?;
        }
        write!(f, "/{}", esc(&self.image))?;
        if let Some(snap) = &self.snapshot {
            write!(f, "@{}", esc(snap))?;
        }
        Ok(())
    }
}

/// Splits at each `delim` not preceded by a backslash; escapes stay in the pieces.
fn split_unescaped(s: &str, delim: char) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut start, mut escaped) = (0, false);
    for (i, c) in s.char_indices() {
        if escaped {
            escaped = false;
        } else if c == '\\' {
            escaped = true;
        } else if c == delim {
            out.push(&s[start..i]);
            start = i + c.len_utf8();
        }
    }
    out.push(&s[start..]);
    out
}

/// Drops each escaping backslash (a trailing lone backslash is kept).
fn unescape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\\' {
            out.push(chars.next().unwrap_or('\\'));
        } else {
            out.push(c);
        }
    }
    out
}

fn nonempty(s: &str, what: &str) -> std::result::Result<String, String> {
    let u = unescape(s);
    if u.is_empty() {
        Err(format!("{what} is empty"))
    } else {
        Ok(u)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_table() {
        // (name, pool, namespace, image, snapshot, conf, id, keyring, settings)
        type Row = (
            &'static str,
            &'static str,
            Option<&'static str>,
            &'static str,
            Option<&'static str>,
            Option<&'static str>,
            Option<&'static str>,
            Option<&'static str>,
            &'static [(&'static str, &'static str)],
        );
        let rows: &[Row] = &[
            (
                "rbd:rbd/img",
                "rbd",
                None,
                "img",
                None,
                None,
                None,
                None,
                &[],
            ),
            (
                "rbd:p/ns/img",
                "p",
                Some("ns"),
                "img",
                None,
                None,
                None,
                None,
                &[],
            ),
            (
                "rbd:p/img@snap1",
                "p",
                None,
                "img",
                Some("snap1"),
                None,
                None,
                None,
                &[],
            ),
            (
                "rbd:p/img:conf=/tmp/c/ceph.conf:id=admin",
                "p",
                None,
                "img",
                None,
                Some("/tmp/c/ceph.conf"),
                Some("admin"),
                None,
                &[],
            ),
            (
                "rbd:p/img@s:keyring=/k:mon_host=127.0.0.1\\:3300",
                "p",
                None,
                "img",
                Some("s"),
                None,
                None,
                Some("/k"),
                &[("mon_host", "127.0.0.1:3300")],
            ),
            (
                "rbd:p/a\\:b\\@c",
                "p",
                None,
                "a:b@c",
                None,
                None,
                None,
                None,
                &[],
            ),
            ("rbd:p/a\\/b", "p", None, "a/b", None, None, None, None, &[]),
            (
                "rbd:p/img:a=b=c",
                "p",
                None,
                "img",
                None,
                None,
                None,
                None,
                &[("a", "b=c")],
            ),
        ];
        for &(name, pool, ns, image, snap, conf, id, keyring, settings) in rows {
            let s = RbdSpec::parse(name).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(s.pool, pool, "{name}");
            assert_eq!(s.namespace.as_deref(), ns, "{name}");
            assert_eq!(s.image, image, "{name}");
            assert_eq!(s.snapshot.as_deref(), snap, "{name}");
            assert_eq!(s.options.conf, conf.map(PathBuf::from), "{name}");
            assert_eq!(s.options.id.as_deref(), id, "{name}");
            assert_eq!(s.options.keyring, keyring.map(PathBuf::from), "{name}");
            let want: Vec<(String, String)> = settings
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            assert_eq!(s.options.settings, want, "{name}");
            assert_eq!(s.options.remote_timeout, REMOTE_TIMEOUT_DEFAULT);
            // Display gives back the path part, which parses to the same image.
            let shown = s.to_string();
            let again = RbdSpec::parse(&shown).unwrap();
            assert_eq!(
                (again.pool, again.namespace, again.image, again.snapshot),
                (s.pool, s.namespace, s.image, s.snapshot),
                "{name} -> {shown}"
            );
        }
    }

    #[test]
    fn refuses_table() {
        // (name, the error must mention)
        let rows = [
            ("rbd/img", "rbd:"),
            ("rbd:", "POOL/IMAGE"),
            ("rbd:img", "POOL/IMAGE"),
            ("rbd:a/b/c/d", "POOL/IMAGE"),
            ("rbd:/img", "pool name is empty"),
            ("rbd:p/", "image name is empty"),
            ("rbd:p//img", "namespace is empty"),
            ("rbd:p/img@", "snapshot name"),
            ("rbd:p/img@a@b", "more than one '@'"),
            ("rbd:p/img:conf", "not KEY=VALUE"),
            ("rbd:p/img:", "not KEY=VALUE"),
            ("rbd:p/img:=x", "no key"),
            ("rbd:p/img:id=a:id=b", "given twice"),
        ];
        for (name, needle) in rows {
            match RbdSpec::parse(name) {
                Ok(s) => panic!("{name}: accepted as {s:?}"),
                Err(e) => {
                    assert!(matches!(e, Error::InvalidArgument(_)), "{name}: {e:?}");
                    assert!(e.to_string().contains(needle), "{name}: {e}");
                }
            }
        }
        let many = format!("rbd:p/i{}", ":a=b".repeat(SETTINGS_MAX + 1));
        assert!(RbdSpec::parse(&many)
            .unwrap_err()
            .to_string()
            .contains("more than"));
    }

    #[test]
    fn is_rbd_and_image_path() {
        assert!(RbdSpec::is_rbd("rbd:p/i"));
        assert!(!RbdSpec::is_rbd("/dev/rbd0"));
        let mut s = RbdSpec::new("p", "i");
        assert_eq!(s.image_path(), "p/i");
        s.namespace = Some("n".into());
        s.snapshot = Some("s".into());
        assert_eq!(s.image_path(), "p/n/i@s");
        assert_eq!(s.to_string(), "rbd:p/n/i@s");
    }
}
