//! cryptsetup's old verb spellings (`cryptsetup.c`, "Handle aliases"): each names `open` or
//! `close` with a device type, and `create` is `open --type plain` with its historical
//! argument order, the name first. They are rewritten here, before the command line is parsed,
//! into the verbs ucrypt's grammar has; `luksOpen`, `luksClose`, `luksErase` and the other
//! one-to-one spellings are aliases in the grammar itself.

/// The alias, and the `--type` of the `open` it stands for.
const OPEN_ALIASES: &[(&str, &str)] = &[
    ("create", "plain"),
    ("plainOpen", "plain"),
    ("loopaesOpen", "loopaes"),
    ("tcryptOpen", "tcrypt"),
    ("bitlkOpen", "bitlk"),
    ("fvault2Open", "fvault2"),
];

/// cryptsetup's spellings of `close`.
pub const CLOSE_ALIASES: &[&str] = &[
    "remove",
    "plainClose",
    "loopaesClose",
    "tcryptClose",
    "bitlkClose",
    "fvault2Close",
];

/// What the rewrite did that the parsed command must still be told.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Rewritten {
    /// `create NAME DEVICE`: the parsed volume is the name and the name the volume.
    pub name_first: bool,
}

/// Rewrites the verb of `argv` when it is one of [`OPEN_ALIASES`]: `VERB` becomes `open
/// --type TYPE`. The verb is the first word after the program name that is an alias (options
/// may come before it, as cryptsetup allows). Other command lines are returned unchanged.
pub fn expand(mut argv: Vec<String>) -> (Vec<String>, Rewritten) {
    let found = argv.iter().enumerate().skip(1).find_map(|(i, a)| {
        OPEN_ALIASES
            .iter()
            .find(|(alias, _)| a == alias)
            .map(|&(alias, t)| (i, alias, t))
    });
    let Some((at, alias, device_type)) = found else {
        return (argv, Rewritten::default());
    };
    argv[at] = "open".into();
    argv.splice(
        at + 1..at + 1,
        ["--type".to_string(), device_type.to_string()],
    );
    let name_first = alias == "create";
    (argv, Rewritten { name_first })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn aliases_become_open_with_a_type() {
        let rows: &[(&str, &str, bool)] = &[
            (
                "ucrypt plainOpen /dev/x n",
                "ucrypt open --type plain /dev/x n",
                false,
            ),
            (
                "ucrypt create n /dev/x -c aes-xts-plain64",
                "ucrypt open --type plain n /dev/x -c aes-xts-plain64",
                true,
            ),
            (
                "ucrypt -q tcryptOpen /dev/x n",
                "ucrypt -q open --type tcrypt /dev/x n",
                false,
            ),
            (
                "ucrypt bitlkOpen /dev/x n",
                "ucrypt open --type bitlk /dev/x n",
                false,
            ),
            (
                "ucrypt fvault2Open /dev/x n",
                "ucrypt open --type fvault2 /dev/x n",
                false,
            ),
            (
                "ucrypt loopaesOpen /dev/x n --key-file k",
                "ucrypt open --type loopaes /dev/x n --key-file k",
                false,
            ),
            (
                "ucrypt luksOpen /dev/x n",
                "ucrypt luksOpen /dev/x n",
                false,
            ),
            ("ucrypt close n", "ucrypt close n", false),
        ];
        for (from, to, name_first) in rows {
            let (argv, r) = expand(words(from));
            assert_eq!(argv, words(to), "{from}");
            assert_eq!(r.name_first, *name_first, "{from}");
        }
    }
}
