//! Choosing between the two header copies: a pure function of their validity and seqids, so
//! the choice is tested as a truth table without a device (`luks::tests`).

/// Which copy a reader uses, and which one it should rewrite.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Which {
    Primary,
    Secondary,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Selection {
    pub use_copy: Which,
    /// The other copy is invalid or stale and should be rewritten from `use_copy`.
    pub repair: Option<Which>,
}

/// Chooses between the copies given their validity (`Some(seqid)` when valid). Pure, so it is
/// tested as a truth table: the higher seqid wins; equal seqids prefer the primary; a single
/// valid copy wins and the other is repaired; none valid is an error (`None`).
pub fn select_copy(primary: Option<u64>, secondary: Option<u64>) -> Option<Selection> {
    use Which::*;
    let sel = |use_copy, repair| Some(Selection { use_copy, repair });
    match (primary, secondary) {
        (Some(p), Some(s)) if p > s => sel(Primary, Some(Secondary)),
        (Some(p), Some(s)) if s > p => sel(Secondary, Some(Primary)),
        (Some(_), Some(_)) => sel(Primary, None),
        (Some(_), None) => sel(Primary, Some(Secondary)),
        (None, Some(_)) => sel(Secondary, Some(Primary)),
        (None, None) => None,
    }
}
