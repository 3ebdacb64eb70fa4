//! The report as Markdown: the rows, the sweeps' tables and the per-phase breakdown.

use super::rows::*;

pub fn markdown(r: &EngineReport) -> String {
    let mut o = String::new();
    o += &format!(
        "# ucrypt bench engine{}\n\nMachine: {}. {} round-robin runs; median (min–max).\n\n",
        if r.quick { " --quick" } else { "" },
        r.machine.describe(),
        r.runs
    );
    for n in &r.notes {
        o += &format!("- {n}\n");
    }
    let (plain, swept): (Vec<&Row>, Vec<&Row>) = r
        .rows
        .iter()
        .partition(|row| row.block_bytes.is_none() && row.threads.is_none());
    let mut last = "";
    for row in plain {
        if row.scenario != last {
            o += &format!(
                "\n## {}\n\n| backend | cipher | variant | {} | ÷ raw | |\n|---|---|---|---|---|---|\n",
                row.scenario, row.unit
            );
            last = row.scenario;
        }
        let extra: Vec<String> = row
            .extra
            .iter()
            .map(|(k, v)| format!("{k} {}", v.show(2)))
            .collect();
        let raw = r.rows.iter().find(|x| {
            x.variant == "raw"
                && x.scenario == row.scenario
                && x.backend == row.backend
                && x.cipher == row.cipher
        });
        let ratio = match raw {
            Some(x) if row.variant != "raw" => format!("{:.2}", row.value.median / x.value.median),
            _ => String::new(),
        };
        o += &format!(
            "| {} | {} | {} | {} | {} | {} |\n",
            row.backend,
            row.cipher,
            row.variant,
            row.value.show(if row.unit.contains("µs") { 2 } else { 0 }),
            ratio,
            extra.join(", ")
        );
    }
    o += &sweep_tables(&swept);
    o += &targets_table(&r.targets);
    o += &breakdown_table(&r.breakdown);
    o
}

/// The targets, each beside the ceiling measured with it (the same ratio without ucrypt, in
/// the same run), and a count of the verdicts.
pub(crate) fn targets_table(targets: &[TargetCheck]) -> String {
    let mut o = format!(
        "\n## Targets\n\nThis machine allows: the same ratio without ucrypt, measured beside \
         it in this run. A target above it is checked against {CEILING_SHARE} of it.\n\n\
         | check | measured | target | this machine allows | measured ÷ allowed | |\n\
         |---|---|---|---|---|---|\n"
    );
    for t in targets {
        let (allows, share) = match t.ceiling {
            Some(c) => (
                format!("{c:.2}"),
                format!("{:.2} of what this machine allows", t.measured / c),
            ),
            None => ("–".into(), "–".into()),
        };
        o += &format!(
            "| {} | {:.2} | ≥ {:.2} | {allows} | {share} | {} |\n",
            t.what,
            t.measured,
            t.target,
            t.verdict.label()
        );
    }
    let count = |v: Verdict| targets.iter().filter(|t| t.verdict == v).count();
    o += &format!(
        "\n{} of {} targets met; {} more met against this machine's ceiling; {} missed.\n",
        count(Verdict::Met),
        targets.len(),
        count(Verdict::MetAgainstCeiling),
        count(Verdict::Missed)
    );
    o
}

/// Sweep rows (scenarios 7 and 8) as one table per scenario: a row per variant, a column per
/// block size or thread count; medians only (the JSON keeps min–max).
pub(super) fn sweep_tables(rows: &[&Row]) -> String {
    let mut o = String::new();
    let mut scenarios: Vec<&str> = Vec::new();
    for r in rows {
        if !scenarios.contains(&r.scenario) {
            scenarios.push(r.scenario);
        }
    }
    for sc in scenarios {
        let these: Vec<&&Row> = rows.iter().filter(|r| r.scenario == sc).collect();
        let key = |r: &Row| r.block_bytes.unwrap_or(r.threads.unwrap_or(0) as u64);
        let mut cols: Vec<u64> = these.iter().map(|r| key(r)).collect();
        cols.dedup();
        let mut variants: Vec<&str> = Vec::new();
        for r in &these {
            if !variants.contains(&r.variant.as_str()) {
                variants.push(&r.variant);
            }
        }
        let head: Vec<String> = cols
            .iter()
            .map(|&c| {
                if these[0].block_bytes.is_some() {
                    format!("{} KiB", c >> 10)
                } else {
                    format!("{c} thr")
                }
            })
            .collect();
        o += &format!(
            "\n## {sc} ({}, {}, {})\n\n| variant | {} |\n|---|{}\n",
            these[0].backend,
            these[0].cipher,
            these[0].unit,
            head.join(" | "),
            "---|".repeat(cols.len())
        );
        for v in variants {
            let cells: Vec<String> = cols
                .iter()
                .map(|&c| {
                    these
                        .iter()
                        .find(|r| r.variant == v && key(r) == c)
                        .map_or("–".into(), |r| format!("{:.0}", r.value.median))
                })
                .collect();
            o += &format!("| {v} | {} |\n", cells.join(" | "));
        }
    }
    o
}

/// The per-stage breakdown as a table (mean ns per timed request).
pub fn breakdown_table(b: &[Breakdown]) -> String {
    let mut o = String::from(
        "\n## Where time went (Volume::stats of each variant's last run; mean ns per request)\n\n\
         Stages of split requests add up over their chunks, so they can exceed the total.\n\n\
         | backend | scenario | variant | op | requests | split | wait | queue | crypto | device | total |\n\
         |---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for x in b {
        o += &format!(
            "| {} | {} | {} | {} | {} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} |\n",
            x.backend,
            x.scenario,
            x.variant,
            x.op,
            x.requests,
            x.split,
            x.wait_ns,
            x.queue_ns,
            x.crypto_ns,
            x.device_ns,
            x.total_ns
        );
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(what: &str, measured: f64, target: f64, ceiling: Option<f64>) -> TargetCheck {
        let mut v = Vec::new();
        super::super::rows::target(&mut v, what.into(), measured, target, ceiling);
        v.remove(0)
    }

    /// Each ratio is stated against its ceiling; a target above the machine's ceiling is
    /// missed only below CEILING_SHARE of it; the count line adds up.
    #[test]
    fn targets_table_states_ratios_against_the_ceiling() {
        let t = [
            check("split", 1.18, 1.8, Some(1.23)),
            check("split, slow", 0.80, 1.8, Some(1.23)),
            check("null", 0.94, 0.97, None),
            check("limit", 0.93, 0.9, Some(0.95)),
        ];
        let o = targets_table(&t);
        assert!(
            o.contains("| split | 1.18 | ≥ 1.80 | 1.23 | 0.96 of what this machine allows | met against this machine's ceiling |"),
            "{o}"
        );
        assert!(o.contains("| split, slow | 0.80 | ≥ 1.80 | 1.23 | 0.65 of what this machine allows | MISSED |"), "{o}");
        assert!(
            o.contains("| null | 0.94 | ≥ 0.97 | – | – | MISSED |"),
            "{o}"
        );
        assert!(
            o.contains("| limit | 0.93 | ≥ 0.90 | 0.95 | 0.98 of what this machine allows | met |"),
            "{o}"
        );
        assert!(
            o.contains("1 of 4 targets met; 1 more met against this machine's ceiling; 2 missed."),
            "{o}"
        );
    }
}
