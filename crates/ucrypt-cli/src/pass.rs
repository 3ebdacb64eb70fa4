//! Passphrases and key files, read the way cryptsetup reads them:
//! - `--key-file F`: the file's bytes (after `--keyfile-offset`, at most `--keyfile-size`);
//!   `-` reads standard input the same way (binary, newlines included);
//! - no key file, stdin a terminal: a prompt without echo (asked twice when creating);
//! - no key file, stdin not a terminal: one line of standard input, newline stripped; under
//!   systemd (a service: INVOCATION_ID set) through `systemd-ask-password` instead.

use std::io::{Read, Write};

use ucrypt::{Error, Result, SecretBytes};

/// cryptsetup's default maximum key file size (8 MiB).
pub const KEYFILE_BYTES_MAX: u64 = 8 << 20;
/// The first read of a key file: a passphrase or a 512-bit key fits many times over; the
/// buffer doubles from here up to [`KEYFILE_BYTES_MAX`] as a longer file needs it.
const KEYFILE_READ_FIRST_BYTES: usize = 4096;
/// Longest passphrase read from a prompt or a line of stdin.
pub const PASSPHRASE_BYTES_MAX: usize = 512;

pub fn stdin_is_tty() -> bool {
    // SAFETY: isatty only inspects the descriptor.
    unsafe { libc::isatty(0) == 1 }
}

pub fn stderr_is_tty() -> bool {
    // SAFETY: as above.
    unsafe { libc::isatty(2) == 1 }
}

/// Reads a key file (or stdin for "-") with cryptsetup's offset/size semantics. The key bytes
/// go straight into a [`SecretBytes`] (no growing Vec leaving copies behind); the skipped
/// offset goes through a small scratch buffer.
pub fn read_key_file(path: &str, offset: u64, size: Option<u64>) -> Result<SecretBytes> {
    let limit = size.unwrap_or(KEYFILE_BYTES_MAX).min(KEYFILE_BYTES_MAX) as usize;
    let mut src: Box<dyn Read> = if path == "-" {
        Box::new(std::io::stdin().lock())
    } else {
        Box::new(
            // A key file that cannot be opened is a wrong parameter (cryptsetup exits 1), not a
            // wrong device.
            std::fs::File::open(path).map_err(|e| {
                Error::InvalidArgument(format!("Failed to open key file {path}: {e}"))
            })?,
        )
    };
    let ctx = |e| Error::io(format!("reading key file {path}"), e);
    let mut skip = offset;
    let mut scratch = SecretBytes::zeroed(4096);
    while skip > 0 {
        let want = skip.min(scratch.len() as u64) as usize;
        let n = src.read(&mut scratch.as_mut()[..want]).map_err(ctx)?;
        if n == 0 {
            return Err(Error::InvalidArgument(format!(
                "cannot seek to requested keyfile offset {offset} in {path}"
            )));
        }
        skip -= n as u64;
    }
    // The buffer grows as the file proves long: a 45-byte key file is not read into 8 MiB of
    // zeroed, locked memory (zeroing 8 MiB is a visible share of a small volume's key rotation).
    let mut buf = SecretBytes::zeroed(limit.min(KEYFILE_READ_FIRST_BYTES));
    let mut got = 0usize;
    while got < limit {
        if got == buf.len() {
            let mut bigger = SecretBytes::zeroed((got * 2).min(limit));
            bigger.as_mut()[..got].copy_from_slice(&buf.as_ref()[..got]);
            buf = bigger;
        }
        match src.read(&mut buf.as_mut()[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(ctx(e)),
        }
    }
    if size.is_none() && got == limit {
        // More than the most a key file may hold (/dev/zero, a disk given by mistake).
        let mut more = [0u8; 1];
        if src.read(&mut more).map_err(ctx)? > 0 {
            return Err(Error::InvalidArgument(format!(
                "Maximum keyfile size exceeded: {path} holds more than {KEYFILE_BYTES_MAX} bytes"
            )));
        }
    }
    if let Some(n) = size {
        if (got as u64) < n {
            return Err(Error::InvalidArgument(format!(
                "cannot read {n} bytes from key file {path}"
            )));
        }
    }
    if got == 0 {
        return Err(Error::InvalidArgument(format!(
            "nothing to read from key file {path}"
        )));
    }
    Ok(buf.slice(0..got))
}

/// One line from stdin without buffering past the newline (a later read gets the next line).
fn read_stdin_line() -> Result<SecretBytes> {
    let mut line = SecretBytes::zeroed(PASSPHRASE_BYTES_MAX);
    let mut n = 0usize;
    let mut byte = [0u8; 1];
    loop {
        // SAFETY: reading one byte into a valid one-byte buffer.
        let r = unsafe { libc::read(0, byte.as_mut_ptr().cast(), 1) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(Error::io("reading passphrase from standard input", e));
        }
        if r == 0 || byte[0] == b'\n' {
            break;
        }
        if n == PASSPHRASE_BYTES_MAX {
            return Err(Error::InvalidArgument(format!(
                "passphrase longer than {PASSPHRASE_BYTES_MAX} bytes"
            )));
        }
        line.as_mut()[n] = byte[0];
        n += 1;
    }
    Ok(line.slice(0..n))
}

/// Terminal echo off while reading; restored on drop (also on error).
struct NoEcho {
    saved: Option<libc::termios>,
}

impl NoEcho {
    fn new() -> Self {
        // SAFETY: termios is plain data; tcgetattr fills it or fails.
        let mut t: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: fd 0 and a valid termios pointer.
        if unsafe { libc::tcgetattr(0, &mut t) } != 0 {
            return NoEcho { saved: None };
        }
        let saved = t;
        t.c_lflag &= !libc::ECHO;
        t.c_lflag |= libc::ECHONL;
        // SAFETY: as above.
        unsafe { libc::tcsetattr(0, libc::TCSAFLUSH, &t) };
        NoEcho { saved: Some(saved) }
    }
}

impl Drop for NoEcho {
    fn drop(&mut self) {
        if let Some(t) = self.saved {
            // SAFETY: restoring the attributes read in new().
            unsafe { libc::tcsetattr(0, libc::TCSAFLUSH, &t) };
        }
    }
}

/// How interactive prompts behave (cryptsetup's `--timeout` and `--verify-passphrase`), set
/// once from the command line.
#[derive(Clone, Copy, Debug, Default)]
pub struct PromptSettings {
    /// Seconds a prompt waits for the first keystroke; `None`: no limit.
    pub timeout_secs: Option<u32>,
    /// Every passphrase typed on a terminal is asked twice, not only new ones.
    pub always_verify: bool,
}

static PROMPTS: std::sync::OnceLock<PromptSettings> = std::sync::OnceLock::new();

/// Sets the prompts' behaviour for this process (the first call wins).
pub fn configure_prompts(s: PromptSettings) {
    let _ = PROMPTS.set(s);
}

fn prompt_settings() -> PromptSettings {
    PROMPTS.get().copied().unwrap_or_default()
}

/// Waits until standard input has something to read, at most `secs` seconds (cryptsetup's
/// `--timeout`: the prompt gives up when nothing is typed in time).
fn wait_for_input(secs: u32) -> Result<()> {
    let mut fds = libc::pollfd {
        fd: 0,
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = i32::try_from(u64::from(secs) * 1000).unwrap_or(i32::MAX);
    loop {
        // SAFETY: one valid pollfd, its count 1; poll writes only its revents.
        let r = unsafe { libc::poll(&mut fds, 1, ms) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(Error::io("waiting for the passphrase", e));
        }
        if r == 0 {
            eprintln!();
            return Err(Error::InvalidArgument(format!(
                "Error reading passphrase from terminal: nothing typed in {secs} s (--timeout)."
            )));
        }
        return Ok(());
    }
}

fn prompt(text: &str) -> Result<SecretBytes> {
    eprint!("{text}");
    let _ = std::io::stderr().flush();
    let _guard = NoEcho::new();
    if let Some(secs) = prompt_settings().timeout_secs {
        wait_for_input(secs)?;
    }
    read_stdin_line()
}

/// The agent systemd's services ask passphrases through (their stdin is /dev/null).
const ASK_PASSWORD: &str = "systemd-ask-password";

/// A service that systemd started (it sets INVOCATION_ID) and can ask through its agent.
fn under_systemd() -> bool {
    std::env::var_os("INVOCATION_ID").is_some()
        && std::env::var_os("PATH")
            .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(ASK_PASSWORD).is_file()))
}

/// Asks through `systemd-ask-password` (a console, Plymouth or a `systemd-tty-ask-password-agent`
/// answers); the answer comes back on its standard output, read straight into a secret.
fn ask_systemd(prompt_text: &str) -> Result<SecretBytes> {
    let mut child = std::process::Command::new(ASK_PASSWORD)
        .args(["--id=ucrypt", "--timeout=0", prompt_text.trim_end()])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| Error::io(format!("running {ASK_PASSWORD}"), e))?;
    let mut out = child.stdout.take().ok_or(Error::Bug("no stdout pipe"))?;
    // One byte more than a passphrase may have, for the newline.
    let mut buf = SecretBytes::zeroed(PASSPHRASE_BYTES_MAX + 1);
    let mut n = 0;
    while n < buf.len() {
        match out.read(&mut buf.as_mut()[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::io(format!("reading from {ASK_PASSWORD}"), e)),
        }
    }
    let status = child
        .wait()
        .map_err(|e| Error::io(format!("waiting for {ASK_PASSWORD}"), e))?;
    if !status.success() {
        return Err(Error::InvalidArgument(format!(
            "{ASK_PASSWORD} got no passphrase ({status})"
        )));
    }
    if n > 0 && buf.as_ref()[n - 1] == b'\n' {
        n -= 1;
    } else if n > PASSPHRASE_BYTES_MAX {
        return Err(Error::InvalidArgument(format!(
            "passphrase longer than {PASSPHRASE_BYTES_MAX} bytes"
        )));
    }
    Ok(buf.slice(0..n))
}

/// The key file options of the verbs that read a passphrase (cryptsetup's `--key-file`,
/// `--keyfile-offset`, `--keyfile-size`), flattened into each verb's arguments.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct KeyFileArgs {
    /// Passphrase from this file ("-" = stdin); without it the passphrase is asked.
    #[arg(long, short = 'd')]
    pub key_file: Option<String>,
    /// Skip this many bytes of the key file.
    #[arg(long)]
    pub keyfile_offset: Option<u64>,
    /// Read at most this many bytes of the key file.
    #[arg(long, short = 'l')]
    pub keyfile_size: Option<u64>,
}

impl KeyFileArgs {
    /// Where the passphrase comes from: the key file (at its offset, at most its size), else
    /// standard input or the terminal.
    pub fn source(&self) -> Source<'_> {
        Source {
            key_file: self.key_file.as_deref(),
            offset: self.keyfile_offset.unwrap_or(0),
            size: self.keyfile_size,
        }
    }
}

/// Where a passphrase comes from.
pub struct Source<'a> {
    pub key_file: Option<&'a str>,
    pub offset: u64,
    pub size: Option<u64>,
}

/// cryptsetup's default `--tries`.
pub const TRIES_DEFAULT: u32 = 3;

/// How many times a passphrase is asked for before a wrong one is final (cryptsetup's
/// `--tries`, default 3): only when it is typed on a terminal; a key file, a pipe or systemd's
/// agent give one answer. `--tries 0` asks once, as cryptsetup's does.
pub fn tries(asked: Option<u32>, key_file: Option<&str>) -> u32 {
    if key_file.is_none() && stdin_is_tty() {
        asked.unwrap_or(TRIES_DEFAULT).max(1)
    } else {
        1
    }
}

/// Runs `attempt` (ask for a passphrase and try it) up to `tries` times while it fails with a
/// wrong passphrase (`is_wrong`), telling the user so before asking again, as cryptsetup
/// does ("No key available with this passphrase."). The last failure is returned, for the
/// caller's error path to print and turn into an exit code.
pub fn retry_wrong<T, E>(
    tries: u32,
    is_wrong: impl Fn(&E) -> bool,
    mut attempt: impl FnMut() -> std::result::Result<T, E>,
) -> std::result::Result<T, E> {
    let mut left = tries.max(1);
    loop {
        match attempt() {
            Err(e) if left > 1 && is_wrong(&e) => {
                eprintln!("{}", Error::WrongPassphrase);
                left -= 1;
            }
            r => return r,
        }
    }
}

/// Reads a passphrase. `verify` asks twice on a terminal (for new passphrases).
pub fn read_passphrase(src: &Source<'_>, prompt_text: &str, verify: bool) -> Result<SecretBytes> {
    if let Some(f) = src.key_file {
        return read_key_file(f, src.offset, src.size);
    }
    if !stdin_is_tty() {
        if under_systemd() {
            return ask_systemd(prompt_text);
        }
        return read_stdin_line();
    }
    let p = prompt(prompt_text)?;
    if verify || prompt_settings().always_verify {
        let again = prompt("Verify passphrase: ")?;
        if !again.ct_eq(p.as_ref()) {
            return Err(Error::PassphraseMismatch);
        }
    }
    Ok(p)
}

/// cryptsetup's confirmation: the answer must be "YES". Batch mode skips it, and so does a
/// stdin that is no terminal (cryptsetup asks only a terminal: a script's pipe carries
/// passphrases, not answers).
pub fn confirm(batch: bool, message: &str) -> Result<()> {
    if batch || !stdin_is_tty() {
        return Ok(());
    }
    eprint!("\nWARNING!\n========\n{message}\n\nAre you sure? (Type 'yes' in capital letters): ");
    let _ = std::io::stderr().flush();
    let answer = read_stdin_line()?;
    if answer.as_ref() == b"YES" {
        Ok(())
    } else {
        Err(Error::InvalidArgument("Operation aborted.".into()))
    }
}

/// The payload of the kernel keyring's `user` key named `description` (the passphrase of a
/// `luks2-keyring` token), found as request_key(2) finds it (the thread's, process's and
/// session's keyrings). `None` when there is no such key or no keyring (a container without
/// keyctl); at most [`PASSPHRASE_BYTES_MAX`] bytes.
pub fn keyring_passphrase(description: &str) -> Option<SecretBytes> {
    const KEYCTL_READ: libc::c_long = 11;
    let desc = std::ffi::CString::new(description).ok()?;
    // SAFETY: both strings are NUL-terminated and outlive the call; a null callout and
    // destination keyring 0 are request_key(2)'s documented "no callout, no linking".
    let id = unsafe {
        libc::syscall(
            libc::SYS_request_key,
            c"user".as_ptr(),
            desc.as_ptr(),
            std::ptr::null::<libc::c_char>(),
            0 as libc::c_long,
        )
    };
    if id < 0 {
        return None;
    }
    let mut buf = SecretBytes::zeroed(PASSPHRASE_BYTES_MAX);
    // SAFETY: `buf` is a live, writable buffer of exactly the length passed; KEYCTL_READ
    // writes at most that many bytes and returns the payload's full length.
    let n = unsafe {
        libc::syscall(
            libc::SYS_keyctl,
            KEYCTL_READ,
            id,
            buf.as_mut().as_mut_ptr(),
            PASSPHRASE_BYTES_MAX,
        )
    };
    if n < 0 || n as usize > PASSPHRASE_BYTES_MAX {
        return None;
    }
    Some(buf.slice(0..n as usize))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A key file of `len` bytes (a pattern that differs at every offset within 251 bytes),
    /// in the target's scratch directory; removed on drop.
    struct KeyFile(std::path::PathBuf, Vec<u8>);

    impl KeyFile {
        fn new(name: &str, len: usize) -> Self {
            let dir = std::env::temp_dir().join(format!("ucrypt-pass-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let path = dir.join(name);
            let bytes: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
            std::fs::write(&path, &bytes).unwrap();
            KeyFile(path, bytes)
        }

        fn read(&self, offset: u64, size: Option<u64>) -> Result<SecretBytes> {
            read_key_file(self.0.to_str().unwrap(), offset, size)
        }
    }

    impl Drop for KeyFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    #[test]
    fn key_files_are_read_whole_across_the_buffer_growth() {
        let first = KEYFILE_READ_FIRST_BYTES;
        for len in [1, 45, first - 1, first, first + 1, 3 * first + 7, 1 << 20] {
            let f = KeyFile::new(&format!("len-{len}"), len);
            let got = f.read(0, None).unwrap();
            assert_eq!(got.as_ref(), &f.1[..], "a key file of {len} bytes");
        }
    }

    #[test]
    fn key_file_limits_offsets_and_sizes() {
        let max = KEYFILE_BYTES_MAX as usize;
        let f = KeyFile::new("max", max);
        assert_eq!(f.read(0, None).unwrap().as_ref(), &f.1[..]);
        let over = KeyFile::new("over", max + 1);
        let e = over.read(0, None).unwrap_err().to_string();
        assert!(e.contains("Maximum keyfile size exceeded"), "{e}");
        // An offset and a size read that window, also across the growth.
        let f = KeyFile::new("window", 20_000);
        let got = f.read(5000, Some(9000)).unwrap();
        assert_eq!(got.as_ref(), &f.1[5000..14_000]);
        let e = f.read(15_000, Some(9000)).unwrap_err().to_string();
        assert!(e.contains("cannot read 9000 bytes"), "{e}");
        let empty = KeyFile::new("empty", 0);
        let e = empty.read(0, None).unwrap_err().to_string();
        assert!(e.contains("nothing to read"), "{e}");
    }
}
