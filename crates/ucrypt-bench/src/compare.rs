//! `ucrypt bench compare OLD.json NEW.json`: the deltas between two `--json` results of any
//! scenario (or of `bench all`), without knowing the scenario's structs.
//!
//! The JSON shape and the rule used here are documented in docs/bench-json.md: a report is an
//! object; its arrays of objects are tables of rows; in a row, every object
//! `{median, min, max, ...}` (a `stats::Summary`) and every non-integer number is a metric,
//! every string and integer, at any depth, is part of the row's identity, and booleans are
//! flags (results such as "target met", compared but not identity). Rows of OLD and NEW with
//! the same table and identity are compared metric by metric; rows left over are then paired
//! when their strings alone identify them on both sides, and their differing integers (e.g.
//! request counts) are shown as compared values. Arrays of plain numbers (raw data such as CDF
//! points) are not compared. An object without rows or metrics of its own (e.g. the file of
//! `bench all`) is walked by key.

use std::collections::BTreeMap;
use std::path::PathBuf;

use clap::Args;
use serde_json::{Map, Value};

#[derive(Args)]
pub struct CompareArgs {
    /// The earlier result (`ucrypt bench ... --json > OLD.json`).
    old: PathBuf,
    /// The later result.
    new: PathBuf,
    /// Mark a metric whose median moved by more than this many percent.
    #[arg(long, value_name = "PCT", default_value_t = 5.0)]
    threshold: f64,
}

pub fn run(a: &CompareArgs) -> i32 {
    if !(a.threshold.is_finite() && a.threshold >= 0.0) {
        eprintln!("ucrypt bench compare: --threshold must be a percentage >= 0");
        return 2;
    }
    let load = |p: &PathBuf| -> Result<Flat, String> {
        let text = std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))?;
        let v: Value =
            serde_json::from_str(&text).map_err(|e| format!("{}: not JSON: {e}", p.display()))?;
        flatten(&v).map_err(|e| format!("{}: {e}", p.display()))
    };
    match load(&a.old).and_then(|old| Ok((old, load(&a.new)?))) {
        Ok((old, new)) => {
            print!("{}", render(&compare(&old, &new, a.threshold), a.threshold));
            0
        }
        Err(e) => {
            eprintln!("ucrypt bench compare: {e}");
            1
        }
    }
}

// ---------------------------------------------------------------- flattening

/// A measured value: a Summary's median with its min–max range, or a bare number.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Metric {
    pub median: f64,
    pub range: Option<(f64, f64)>,
}

#[derive(Debug, Clone, Default, PartialEq)]
struct Row {
    /// (field path, value) of strings and arrays of strings or integers (as JSON text).
    text: Vec<(String, String)>,
    /// (field path, value) of integers.
    ints: Vec<(String, i128)>,
    flags: Vec<(String, bool)>,
    metrics: Vec<(String, Metric)>,
}

impl Row {
    fn sort(&mut self) {
        self.text.sort();
        self.ints.sort();
        self.flags.sort();
    }

    /// "aes-xts-plain64 · aws-lc-xts · key_bits=512": strings bare, integers named.
    fn label(&self) -> String {
        self.label_with(self)
    }

    /// The label of a pair: integers that differ in `other` are compared, not named here.
    fn label_with(&self, other: &Row) -> String {
        let last = |p: &str| p.rsplit('.').next().unwrap_or(p).to_string();
        let parts: Vec<String> = self
            .text
            .iter()
            .map(|(_, v)| v.clone())
            .chain(
                self.ints
                    .iter()
                    .filter(|i| other.ints.contains(i))
                    .map(|(p, v)| format!("{}={v}", last(p))),
            )
            .collect();
        if parts.is_empty() {
            "(report)".to_string()
        } else {
            parts.join(" · ")
        }
    }
}

fn integer(n: &serde_json::Number) -> Option<i128> {
    n.as_i64()
        .map(i128::from)
        .or_else(|| n.as_u64().map(i128::from))
}

/// One result file, flattened: tables of rows, machines and settings by path.
#[derive(Debug, Default)]
struct Flat {
    /// Table path ("rows", "engine.rows", or a report's path for its top-level metrics).
    tables: BTreeMap<String, Vec<Row>>,
    /// Report path -> `machine` object.
    machines: BTreeMap<String, Value>,
    /// "path.key" -> scalar settings of a report (schema, runs, quick, ...).
    settings: BTreeMap<String, String>,
}

/// The name of a report's own metrics table when the report is the whole file.
const TOP: &str = "(top level)";
/// Nesting bound: result files are a few levels deep; this stops runaway recursion.
const DEPTH_MAX: usize = 32;

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

fn flatten(v: &Value) -> Result<Flat, String> {
    let Value::Object(o) = v else {
        return Err("not a benchmark report: expected a JSON object".into());
    };
    let mut flat = Flat::default();
    walk_report("", o, &mut flat, 0)?;
    if flat.tables.is_empty() {
        return Err(
            "no benchmark rows found (no arrays of objects, no {median, min, max} metrics)".into(),
        );
    }
    Ok(flat)
}

/// Reads `o` as a Summary: Some if it has `median`; an error if its numbers are not numbers.
/// A NaN median is written by serde_json as null.
fn summary(path: &str, o: &Map<String, Value>) -> Result<Option<Metric>, String> {
    if !o.contains_key("median") {
        return Ok(None);
    }
    let num = |k: &str| -> Result<Option<f64>, String> {
        match o.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Number(n)) => Ok(n.as_f64()),
            Some(other) => Err(format!("{path}.{k}: expected a number, found {other}")),
        }
    };
    let median = num("median")?.unwrap_or(f64::NAN);
    let range = match (num("min")?, num("max")?) {
        (Some(lo), Some(hi)) => Some((lo, hi)),
        _ => None,
    };
    Ok(Some(Metric { median, range }))
}

fn is_float(n: &serde_json::Number) -> bool {
    n.is_f64()
}

/// A report or a group of reports: metrics and tables at this level, groups below.
fn walk_report(
    path: &str,
    o: &Map<String, Value>,
    flat: &mut Flat,
    depth: usize,
) -> Result<(), String> {
    if depth > DEPTH_MAX {
        return Err(format!("{path}: nested deeper than {DEPTH_MAX} levels"));
    }
    let mut own = Row::default();
    for (k, v) in o {
        let p = join(path, k);
        match v {
            // `machine`, or a host description that embeds one (`bench all`'s `host`).
            Value::Object(m) if k == "machine" || m.contains_key("cpu_model") => {
                flat.machines
                    .insert(path.to_string(), Value::Object(m.clone()));
            }
            Value::Object(m) => match summary(&p, m)? {
                Some(metric) => own.metrics.push((k.clone(), metric)),
                None => walk_report(&p, m, flat, depth + 1)?,
            },
            Value::Array(a) if !a.is_empty() && a.iter().all(Value::is_object) => {
                let mut rows = Vec::with_capacity(a.len());
                for (i, r) in a.iter().enumerate() {
                    let mut row = Row::default();
                    walk_row(&format!("{p}[{i}]"), "", r, &mut row, depth + 1)?;
                    row.sort();
                    rows.push(row);
                }
                flat.tables.entry(p).or_default().extend(rows);
            }
            // Otherwise notes, logs: not compared.
            Value::Array(a) => {
                if let Some(ms) = named_metrics(&p, a)? {
                    own.metrics
                        .extend(ms.into_iter().map(|(n, m)| (join(k, &n), m)));
                }
            }
            Value::Number(n) if is_float(n) => own.metrics.push((
                k.clone(),
                Metric {
                    median: n.as_f64().unwrap_or(f64::NAN),
                    range: None,
                },
            )),
            Value::Number(_) | Value::String(_) | Value::Bool(_) => {
                flat.settings.insert(p, v.to_string());
            }
            Value::Null => {}
        }
    }
    if !own.metrics.is_empty() {
        let name = if path.is_empty() { TOP } else { path };
        flat.tables.entry(name.to_string()).or_default().push(own);
    }
    Ok(())
}

/// `[[name, Summary or number], ...]` (a serialised `Vec<(String, Summary)>`) as named metrics.
fn named_metrics(path: &str, a: &[Value]) -> Result<Option<Vec<(String, Metric)>>, String> {
    let mut out = Vec::new();
    for (i, e) in a.iter().enumerate() {
        let Some([Value::String(name), v]) = e.as_array().map(Vec::as_slice) else {
            return Ok(None);
        };
        let metric = match v {
            Value::Object(o) => match summary(&format!("{path}[{i}]"), o)? {
                Some(m) => m,
                None => return Ok(None),
            },
            Value::Number(n) => Metric {
                median: n.as_f64().unwrap_or(f64::NAN),
                range: None,
            },
            _ => return Ok(None),
        };
        out.push((name.clone(), metric));
    }
    Ok((!out.is_empty()).then_some(out))
}

/// One value inside a row, at `field` (dotted path within the row).
fn walk_row(at: &str, field: &str, v: &Value, row: &mut Row, depth: usize) -> Result<(), String> {
    if depth > DEPTH_MAX {
        return Err(format!("{at}: nested deeper than {DEPTH_MAX} levels"));
    }
    let name = |f: &str| {
        if f.is_empty() {
            "value".to_string()
        } else {
            f.to_string()
        }
    };
    match v {
        Value::Object(o) => match summary(&join(at, field), o)? {
            Some(m) => row.metrics.push((name(field), m)),
            None => {
                for (k, v) in o {
                    walk_row(at, &join(field, k), v, row, depth + 1)?;
                }
            }
        },
        Value::Array(a) => {
            if let Some(ms) = named_metrics(&join(at, field), a)? {
                row.metrics
                    .extend(ms.into_iter().map(|(n, m)| (join(field, &n), m)));
            } else if a.iter().all(|e| matches!(e, Value::String(_)))
                || a.iter()
                    .all(|e| matches!(e, Value::Number(n) if !is_float(n)))
            {
                row.text.push((name(field), v.to_string()));
            } else if a.iter().all(Value::is_object) {
                for (i, e) in a.iter().enumerate() {
                    walk_row(at, &format!("{field}[{i}]"), e, row, depth + 1)?;
                }
            }
            // Otherwise raw data (e.g. CDF points of one run): not compared.
        }
        Value::Number(n) if is_float(n) => row.metrics.push((
            name(field),
            Metric {
                median: n.as_f64().unwrap_or(f64::NAN),
                range: None,
            },
        )),
        Value::Number(n) => match integer(n) {
            Some(i) => row.ints.push((name(field), i)),
            None => return Err(format!("{}: number out of range", join(at, field))),
        },
        Value::Bool(b) => row.flags.push((name(field), *b)),
        Value::String(s) => row.text.push((name(field), s.clone())),
        // A NaN written by serde_json: neither identity nor a usable number.
        Value::Null => {}
    }
    Ok(())
}

// ---------------------------------------------------------------- comparing

/// How a metric moved, judged against the threshold and the runs' ranges.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Within the threshold.
    Same,
    /// Beyond the threshold, and each median lies outside the other side's min–max range:
    /// probably a real change.
    Changed,
    /// Beyond the threshold, but the ranges say it may be noise.
    Noise,
    /// Beyond the threshold (or not computable), with no range to judge it by.
    Unknown,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Delta {
    pub table: String,
    pub row: String,
    pub metric: String,
    pub old: Option<Metric>,
    pub new: Option<Metric>,
    /// (new - old) / |old| in percent; None when not computable (0 or NaN old median).
    pub pct: Option<f64>,
    pub verdict: Verdict,
    /// Which way is better for this metric (from its name or its row's unit).
    pub better: Better,
}

/// Which way a metric improves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Better {
    /// Throughput, IOPS, ratios, speed-ups.
    Higher,
    /// Latencies and times.
    Lower,
    /// Neither the metric's name nor its row's unit says (e.g. a target's fixed value).
    Unknown,
}

/// The direction of `metric` (its field path) in a row whose text fields are `text`. By the
/// field's name (`mib_s`, `iops`, `*_gbps`, `ratio`, `*_vs_*`, `measured` are higher-better;
/// `*_ns`, `*_us`, `*_ms`, `lat*`, `alloc*` lower-better), else for a generic `value` by the row's
/// `unit` ("MB/s" higher-better, "µs"/"ns"/"ms" lower-better).
pub fn direction(metric: &str, text: &[(String, String)]) -> Better {
    let name = metric
        .rsplit('.')
        .next()
        .unwrap_or(metric)
        .to_ascii_lowercase();
    let time = |n: &str| {
        n.ends_with("_ns")
            || n.ends_with("_us")
            || n.ends_with("_ms")
            || n.contains("lat")
            || n.contains("alloc")
    };
    if time(&name) {
        return Better::Lower;
    }
    if name.ends_with("gbps")
        || name.ends_with("mib_s")
        || name.ends_with("mb_s")
        || name == "iops"
        || name.contains("ratio")
        || name.contains("_vs_")
        || name == "measured"
    {
        return Better::Higher;
    }
    if name == "value" {
        let unit = text
            .iter()
            .find(|(p, _)| p.rsplit('.').next() == Some("unit"))
            .map(|(_, v)| v.trim_matches('"').to_string())
            .unwrap_or_default();
        if unit.contains("/s") || unit.contains("IOPS") {
            return Better::Higher;
        }
        if unit.contains("µs") || unit.contains("ns") || unit.contains("ms") {
            return Better::Lower;
        }
    }
    Better::Unknown
}

impl Delta {
    /// Some(true) if the change is an improvement, Some(false) if a regression; None when the
    /// metric did not move beyond the threshold or its direction is unknown.
    pub fn improved(&self) -> Option<bool> {
        let p = self.pct?;
        if self.verdict == Verdict::Same || p == 0.0 {
            return None;
        }
        match self.better {
            Better::Higher => Some(p > 0.0),
            Better::Lower => Some(p < 0.0),
            Better::Unknown => None,
        }
    }
}

/// A boolean of a paired row that differs (None: absent on that side).
#[derive(Debug, Clone, PartialEq)]
pub struct FlagChange {
    pub table: String,
    pub row: String,
    pub flag: String,
    pub old: Option<bool>,
    pub new: Option<bool>,
}

#[derive(Debug, Default)]
pub struct Comparison {
    pub deltas: Vec<Delta>,
    /// (table, row label)
    pub only_old: Vec<(String, String)>,
    pub only_new: Vec<(String, String)>,
    pub flags: Vec<FlagChange>,
    pub warnings: Vec<String>,
    /// Report settings that differ ("runs 3 -> 7", start times, versions): for information.
    pub settings: Vec<String>,
}

pub fn judge(old: Metric, new: Metric, threshold_pct: f64) -> (Option<f64>, Verdict) {
    let pct = if old.median.is_finite() && new.median.is_finite() {
        if old.median == new.median {
            Some(0.0)
        } else if old.median != 0.0 {
            Some((new.median - old.median) / old.median.abs() * 100.0)
        } else {
            None
        }
    } else {
        None
    };
    let Some(p) = pct else {
        return (None, Verdict::Unknown);
    };
    if p.abs() <= threshold_pct {
        return (pct, Verdict::Same);
    }
    let verdict = match (old.range, new.range) {
        (Some((olo, ohi)), Some((nlo, nhi))) => {
            let outside = |x: f64, lo: f64, hi: f64| x < lo || x > hi;
            if outside(new.median, olo, ohi) && outside(old.median, nlo, nhi) {
                Verdict::Changed
            } else {
                Verdict::Noise
            }
        }
        _ => Verdict::Unknown,
    };
    (pct, verdict)
}

fn compare(old: &Flat, new: &Flat, threshold_pct: f64) -> Comparison {
    let mut c = Comparison::default();
    machine_warnings(old, new, &mut c.warnings, &mut c.settings);
    let empty = Vec::new();
    let tables: std::collections::BTreeSet<&String> =
        old.tables.keys().chain(new.tables.keys()).collect();
    for table in tables {
        let o = old.tables.get(table).unwrap_or(&empty);
        let n = new.tables.get(table).unwrap_or(&empty);
        for (orow, nrow) in pair_rows(o, n, &mut c, table) {
            compare_rows(table, orow, nrow, threshold_pct, &mut c);
        }
    }
    c
}

/// Pairs the rows of one table; records the rows left over in `c`.
fn pair_rows<'a>(
    o: &'a [Row],
    n: &'a [Row],
    c: &mut Comparison,
    table: &str,
) -> Vec<(&'a Row, &'a Row)> {
    let mut pairs = Vec::new();
    let mut old_left: Vec<Option<&Row>> = o.iter().map(Some).collect();
    let mut new_left: Vec<Option<&Row>> = n.iter().map(Some).collect();
    // Pass 1: same strings and integers; duplicates pair up in order of appearance.
    for slot in old_left.iter_mut() {
        let Some(orow) = *slot else { continue };
        let found = new_left
            .iter_mut()
            .find(|r| r.is_some_and(|r| r.text == orow.text && r.ints == orow.ints))
            .and_then(Option::take);
        if let Some(nrow) = found {
            pairs.push((orow, nrow));
            *slot = None;
        }
    }
    // Pass 2: same strings, when those alone identify the row on both sides.
    let count = |rows: &[Option<&Row>], text: &[(String, String)]| {
        rows.iter().flatten().filter(|r| r.text == text).count()
    };
    for i in 0..old_left.len() {
        let Some(orow) = old_left[i] else { continue };
        if orow.text.is_empty()
            || count(&old_left, &orow.text) != 1
            || count(&new_left, &orow.text) != 1
        {
            continue;
        }
        let found = new_left
            .iter_mut()
            .find(|r| r.is_some_and(|r| r.text == orow.text))
            .and_then(Option::take);
        if let Some(nrow) = found {
            pairs.push((orow, nrow));
            old_left[i] = None;
        }
    }
    for r in old_left.into_iter().flatten() {
        c.only_old.push((table.to_string(), r.label()));
    }
    for r in new_left.into_iter().flatten() {
        c.only_new.push((table.to_string(), r.label()));
    }
    pairs
}

/// A row's metrics, then its integers that differ from `other`'s (compared as plain numbers
/// when rows were paired by their strings).
fn metrics_of(r: &Row, other: &Row) -> Vec<(String, Metric)> {
    let differs = |(p, v): &&(String, i128)| !other.ints.iter().any(|(q, w)| q == p && w == v);
    let ints = r.ints.iter().filter(differs).map(|(p, v)| {
        let m = Metric {
            median: *v as f64,
            range: None,
        };
        (p.clone(), m)
    });
    r.metrics.iter().cloned().chain(ints).collect()
}

fn compare_rows(table: &str, orow: &Row, nrow: &Row, threshold_pct: f64, c: &mut Comparison) {
    let row = orow.label_with(nrow);
    let (om, nm) = (metrics_of(orow, nrow), metrics_of(nrow, orow));
    let mut names: Vec<&String> = om.iter().map(|(m, _)| m).collect();
    for (m, _) in &nm {
        if !names.contains(&m) {
            names.push(m);
        }
    }
    for metric in names {
        let get = |ms: &[(String, Metric)]| ms.iter().find(|(m, _)| m == metric).map(|x| x.1);
        let (a, b) = (get(&om), get(&nm));
        let (pct, verdict) = match (a, b) {
            (Some(a), Some(b)) => judge(a, b, threshold_pct),
            _ => (None, Verdict::Unknown),
        };
        c.deltas.push(Delta {
            table: table.to_string(),
            row: row.clone(),
            metric: metric.clone(),
            old: a,
            new: b,
            pct,
            verdict,
            better: direction(metric, &orow.text),
        });
    }
    let flag = |r: &Row, f: &str| r.flags.iter().find(|(g, _)| g == f).map(|x| x.1);
    let mut seen: Vec<&String> = Vec::new();
    for (f, _) in orow.flags.iter().chain(&nrow.flags) {
        if seen.contains(&f) {
            continue;
        }
        seen.push(f);
        let (a, b) = (flag(orow, f), flag(nrow, f));
        if a != b {
            c.flags.push(FlagChange {
                table: table.to_string(),
                row: row.clone(),
                flag: f.clone(),
                old: a,
                new: b,
            });
        }
    }
}

fn machine_warnings(old: &Flat, new: &Flat, out: &mut Vec<String>, settings: &mut Vec<String>) {
    let at = |p: &str| {
        if p.is_empty() {
            String::new()
        } else {
            format!("{p}: ")
        }
    };
    for (path, om) in &old.machines {
        let Some(nm) = new.machines.get(path) else {
            continue;
        };
        // Not the floats (current clock of each CPU, ...): they move from run to run.
        let has_float = |v: &Value| match v {
            Value::Number(n) => is_float(n),
            Value::Array(a) => a
                .iter()
                .any(|e| matches!(e, Value::Number(n) if is_float(n))),
            _ => false,
        };
        let fields = |m: &Value| -> BTreeMap<String, String> {
            m.as_object()
                .map(|o| {
                    o.iter()
                        .filter(|(_, v)| !has_float(v))
                        .map(|(k, v)| (k.clone(), v.to_string()))
                        .collect()
                })
                .unwrap_or_default()
        };
        let (of, nf) = (fields(om), fields(nm));
        for k in of.keys().chain(nf.keys().filter(|k| !of.contains_key(*k))) {
            let (a, b) = (of.get(k), nf.get(k));
            if a != b {
                let show = |x: Option<&String>| x.cloned().unwrap_or_else(|| "(none)".into());
                out.push(format!(
                    "{}different machines: {k} {} -> {}",
                    at(path),
                    show(a),
                    show(b)
                ));
            }
        }
    }
    for (k, a) in &old.settings {
        if let Some(b) = new.settings.get(k).filter(|b| *b != a) {
            if k == "schema" || k.ends_with(".schema") {
                out.push(format!(
                    "{k} {a} -> {b}: an incompatible change of the JSON shape (docs/bench-json.md)"
                ));
            } else {
                settings.push(format!("{k}: {a} -> {b}"));
            }
        }
    }
}

// ---------------------------------------------------------------- output

fn num(x: f64) -> String {
    if !x.is_finite() {
        return "n/a".into();
    }
    let a = x.abs();
    if a >= 100.0 || a == 0.0 {
        format!("{x:.0}")
    } else if a >= 1.0 {
        format!("{x:.2}")
    } else {
        format!("{x:.4}")
    }
}

fn show(m: Option<Metric>) -> String {
    match m {
        None => "—".into(),
        Some(Metric {
            median,
            range: Some((lo, hi)),
        }) => format!("{} ({}–{})", num(median), num(lo), num(hi)),
        Some(m) => num(m.median),
    }
}

fn marker(v: Verdict) -> &'static str {
    match v {
        Verdict::Same => "",
        Verdict::Changed => "**!!**",
        Verdict::Noise => "~",
        Verdict::Unknown => "?",
    }
}

fn render(c: &Comparison, threshold_pct: f64) -> String {
    let mut s = String::new();
    for w in &c.warnings {
        s += &format!("warning: {w}\n");
    }
    if !c.warnings.is_empty() {
        s += "\n";
    }
    let mut table = "";
    for (i, d) in c.deltas.iter().enumerate() {
        if d.table != table {
            table = &d.table;
            s += &format!(
                "### {table}\n\n| row | metric | old median (min–max) | new median (min–max) | Δ % | | |\n|---|---|---:|---:|---:|---|---|\n"
            );
        }
        let pct = d
            .pct
            .map(|p| format!("{p:+.1} %"))
            .unwrap_or_else(|| "n/a".into());
        let way = match d.improved() {
            Some(true) => "better",
            Some(false) => "worse",
            None => "",
        };
        s += &format!(
            "| {} | {} | {} | {} | {pct} | {} | {way} |\n",
            d.row.replace('|', "\\|"),
            d.metric,
            show(d.old),
            show(d.new),
            marker(d.verdict)
        );
        // Deltas come grouped by table.
        if c.deltas.get(i + 1).is_none_or(|next| next.table != d.table) {
            s += "\n";
        }
    }
    if !c.flags.is_empty() {
        s += "Flags changed:\n";
        let show = |b: &Option<bool>| b.map(|b| b.to_string()).unwrap_or_else(|| "—".into());
        for f in &c.flags {
            s += &format!(
                "- {}: {}: {} {} -> {}\n",
                f.table,
                f.row,
                f.flag,
                show(&f.old),
                show(&f.new)
            );
        }
        s += "\n";
    }
    if !c.settings.is_empty() {
        s += "Settings that differ:\n";
        for x in &c.settings {
            s += &format!("- {x}\n");
        }
        s += "\n";
    }
    for (which, rows) in [("OLD", &c.only_old), ("NEW", &c.only_new)] {
        if !rows.is_empty() {
            s += &format!("Rows only in {which}:\n");
            for (t, r) in rows {
                s += &format!("- {t}: {r}\n");
            }
            s += "\n";
        }
    }
    let count = |v: Verdict| c.deltas.iter().filter(|d| d.verdict == v).count();
    let real = |up: bool| {
        c.deltas
            .iter()
            .filter(|d| d.verdict == Verdict::Changed && d.improved() == Some(up))
            .count()
    };
    s += &format!(
        "{} metrics compared; beyond ±{threshold_pct} %: {} probably real (**!!**: each median outside \
         the other's min–max range; {} better, {} worse), {} within noise (~), {} without a range \
         to judge (?).\n",
        c.deltas.len(),
        count(Verdict::Changed),
        real(true),
        real(false),
        count(Verdict::Noise),
        count(Verdict::Unknown),
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn sum(median: f64, min: f64, max: f64) -> Value {
        json!({"median": median, "min": min, "max": max, "runs": 3})
    }

    fn machine(cpu: &str) -> Value {
        json!({"cpu_model": cpu, "cores": 2, "aes_flags": ["aes", "vaes"], "kernel": "6.1.0"})
    }

    /// An engine-like report: two rows (one with a named extra metric), a report-level metric.
    fn report(cpu: &str, raw: Value, inline: Value) -> Value {
        json!({
            "schema": 1,
            "machine": machine(cpu),
            "runs": 3,
            "notes": ["n"],
            "memcpy_gbps": sum(10.0, 9.0, 11.0),
            "rows": [
                {"scenario": "4K reads", "job": {"bs": 4096, "rw": "read"}, "variant": "raw",
                 "unit": "MB/s", "value": raw, "ratio": 0.5},
                {"scenario": "4K reads", "job": {"bs": 4096, "rw": "read"}, "variant": "inline",
                 "unit": "MB/s", "value": inline, "extra": [["allocs/IO", sum(0.0, 0.0, 0.0)]]}
            ],
            "targets": [["x", 0.9, 0.95, false]]
        })
    }

    fn run(old: &Value, new: &Value) -> Comparison {
        compare(
            &flatten(old).expect("old"),
            &flatten(new).expect("new"),
            5.0,
        )
    }

    /// (row, metric) -> (pct, verdict)
    fn find(c: &Comparison, row: &str, metric: &str) -> (Option<f64>, Verdict) {
        let d = c
            .deltas
            .iter()
            .find(|d| d.row.contains(row) && d.metric == metric)
            .unwrap_or_else(|| panic!("no delta {row} {metric} in {:#?}", c.deltas));
        (d.pct, d.verdict)
    }

    #[test]
    fn identical_files_are_zero_percent() {
        let r = report("EPYC", sum(100.0, 95.0, 105.0), sum(90.0, 85.0, 95.0));
        let c = run(&r, &r);
        // rows: raw (value, ratio), inline (value, extra.allocs/IO); report: memcpy_gbps
        assert_eq!(c.deltas.len(), 5, "{:#?}", c.deltas);
        for d in &c.deltas {
            assert_eq!((d.pct, d.verdict), (Some(0.0), Verdict::Same), "{d:?}");
        }
        assert!(c.only_old.is_empty() && c.only_new.is_empty() && c.warnings.is_empty());
        let text = render(&c, 5.0);
        assert!(text.contains("+0.0 %") && !text.contains("!!|"), "{text}");
    }

    #[test]
    fn judged_rows() {
        // (old, new, pct, verdict)
        let rows = [
            (
                sum(100.0, 99.0, 101.0),
                sum(110.0, 109.0, 111.0),
                10.0,
                Verdict::Changed,
            ),
            (
                sum(100.0, 90.0, 115.0),
                sum(110.0, 100.0, 120.0),
                10.0,
                Verdict::Noise,
            ),
            (
                sum(100.0, 99.0, 101.0),
                sum(90.0, 89.0, 91.0),
                -10.0,
                Verdict::Changed,
            ),
            (
                sum(100.0, 99.0, 101.0),
                sum(103.0, 102.0, 104.0),
                3.0,
                Verdict::Same,
            ),
            // Old range covers the new median, the new range does not cover the old: noise.
            (
                sum(100.0, 80.0, 120.0),
                sum(110.0, 108.0, 112.0),
                10.0,
                Verdict::Noise,
            ),
        ];
        for (old, new, pct, verdict) in rows {
            let inline = sum(90.0, 85.0, 95.0);
            let c = run(
                &report("EPYC", old.clone(), inline.clone()),
                &report("EPYC", new.clone(), inline),
            );
            let (p, v) = find(&c, "raw", "value");
            assert!(
                (p.expect("pct") - pct).abs() < 1e-9,
                "{old} -> {new}: {p:?}"
            );
            assert_eq!(v, verdict, "{old} -> {new}");
        }
    }

    #[test]
    fn metric_directions() {
        // (metric path, the row's unit if any, direction)
        let rows: &[(&str, Option<&str>, Better)] = &[
            ("mib_s", None, Better::Higher),
            ("iops", None, Better::Higher),
            ("hot_gbps", None, Better::Higher),
            ("cold_vs_memcpy", None, Better::Higher),
            ("ratio", None, Better::Higher),
            ("measured", None, Better::Higher),
            ("lat_p99_us", None, Better::Lower),
            ("total_ns", None, Better::Lower),
            ("extra.allocs/IO", None, Better::Lower),
            ("value", Some("MB/s"), Better::Higher),
            ("value", Some("p50 µs"), Better::Lower),
            ("value", None, Better::Unknown),
            ("target", None, Better::Unknown),
        ];
        for &(metric, unit, want) in rows {
            let text: Vec<(String, String)> = unit
                .map(|u| ("unit".to_string(), u.to_string()))
                .into_iter()
                .collect();
            assert_eq!(direction(metric, &text), want, "{metric} {unit:?}");
        }
        // A change beyond the threshold is an improvement or a regression by direction.
        let d = |pct: f64, verdict, better| Delta {
            table: String::new(),
            row: String::new(),
            metric: String::new(),
            old: None,
            new: None,
            pct: Some(pct),
            verdict,
            better,
        };
        // (pct, verdict, direction, improved)
        let cases = [
            (10.0, Verdict::Changed, Better::Higher, Some(true)),
            (-10.0, Verdict::Changed, Better::Higher, Some(false)),
            (10.0, Verdict::Noise, Better::Lower, Some(false)),
            (-10.0, Verdict::Unknown, Better::Lower, Some(true)),
            (3.0, Verdict::Same, Better::Higher, None),
            (10.0, Verdict::Changed, Better::Unknown, None),
        ];
        for (pct, verdict, better, want) in cases {
            assert_eq!(
                d(pct, verdict, better).improved(),
                want,
                "{pct} {verdict:?} {better:?}"
            );
        }
    }

    #[test]
    fn judge_edge_rows() {
        let m = |median: f64, range: Option<(f64, f64)>| Metric { median, range };
        // (old, new, pct, verdict)
        let rows = [
            (m(0.0, None), m(0.0, None), Some(0.0), Verdict::Same),
            (m(0.0, None), m(1.0, None), None, Verdict::Unknown),
            (m(f64::NAN, None), m(1.0, None), None, Verdict::Unknown),
            (m(2.0, None), m(1.0, None), Some(-50.0), Verdict::Unknown),
            (
                m(-2.0, Some((-2.0, -2.0))),
                m(-1.0, Some((-1.0, -1.0))),
                Some(50.0),
                Verdict::Changed,
            ),
        ];
        for (old, new, pct, verdict) in rows {
            assert_eq!(judge(old, new, 5.0), (pct, verdict), "{old:?} -> {new:?}");
        }
    }

    #[test]
    fn rows_added_and_removed() {
        let old = report("EPYC", sum(1.0, 1.0, 1.0), sum(1.0, 1.0, 1.0));
        let mut new = old.clone();
        // The inline row becomes another row (a string of its identity changes), and two
        // rows differing only in an integer are added (their strings do not identify them).
        new["rows"][1]["variant"] = json!("ordered");
        for bs in [512, 1024] {
            let mut added = new["rows"][0].clone();
            added["variant"] = json!("parallel");
            added["job"]["bs"] = json!(bs);
            new["rows"].as_array_mut().expect("rows").push(added);
        }
        let c = run(&old, &new);
        let only = |v: &[(String, String)]| -> Vec<String> {
            let mut v: Vec<String> = v.iter().map(|(t, r)| format!("{t}: {r}")).collect();
            v.sort();
            v
        };
        assert_eq!(
            only(&c.only_old),
            ["rows: read · 4K reads · MB/s · inline · bs=4096"]
        );
        assert_eq!(
            only(&c.only_new),
            [
                "rows: read · 4K reads · MB/s · ordered · bs=4096",
                "rows: read · 4K reads · MB/s · parallel · bs=1024",
                "rows: read · 4K reads · MB/s · parallel · bs=512",
            ]
        );
        let text = render(&c, 5.0);
        assert!(text.contains("Rows only in OLD") && text.contains("Rows only in NEW"));
    }

    #[test]
    fn rows_paired_by_strings_compare_their_integers() {
        // A breakdown-like table: request counts are integers that change from run to run.
        let r = |requests: u64, ns: f64, met: bool| {
            json!({"breakdown": [{"variant": "inline", "op": "read", "requests": requests,
                                  "total_ns": ns}],
                   "targets": [{"what": "inline / raw", "measured": 0.9, "met": met}]})
        };
        let c = run(&r(1000, 500.0, true), &r(1100, 500.0, false));
        assert!(c.only_old.is_empty() && c.only_new.is_empty(), "{c:#?}");
        assert_eq!(
            find(&c, "inline", "requests"),
            (Some(10.0), Verdict::Unknown)
        );
        assert!(
            c.deltas
                .iter()
                .filter(|d| d.table == "breakdown")
                .all(|d| d.row == "read · inline"),
            "{:?}",
            c.deltas
        );
        assert_eq!(find(&c, "inline", "total_ns"), (Some(0.0), Verdict::Same));
        assert_eq!(
            c.flags,
            [FlagChange {
                table: "targets".into(),
                row: "inline / raw".into(),
                flag: "met".into(),
                old: Some(true),
                new: Some(false)
            }]
        );
        assert!(render(&c, 5.0).contains("- targets: inline / raw: met true -> false"));
    }

    #[test]
    fn raw_data_arrays_are_not_compared() {
        // (percentile, µs) points of one run, beside a Summary.
        let r = |p99: f64| json!({"rows": [{"k": "a", "v": sum(1.0, 1.0, 1.0), "cdf": [[50.0, 10.0], [99.0, p99]]}]});
        let c = run(&r(20.0), &r(40.0));
        let metrics: Vec<&str> = c.deltas.iter().map(|d| d.metric.as_str()).collect();
        assert_eq!(metrics, ["v"]);
    }

    #[test]
    fn duplicate_identities_pair_in_order() {
        let r = |a: f64, b: f64| json!({"rows": [{"k": "x", "v": sum(a, a, a)}, {"k": "x", "v": sum(b, b, b)}]});
        let c = run(&r(1.0, 2.0), &r(1.0, 4.0));
        let pcts: Vec<Option<f64>> = c.deltas.iter().map(|d| d.pct).collect();
        assert_eq!(pcts, [Some(0.0), Some(100.0)]);
    }

    #[test]
    fn different_machine_warns() {
        let v = sum(1.0, 1.0, 1.0);
        let old = report("EPYC", v.clone(), v.clone());
        let mut new = report("Xeon", v.clone(), v);
        new["machine"]["kernel"] = json!("6.12.0");
        new["runs"] = json!(7);
        new["schema"] = json!(2);
        let c = run(&old, &new);
        let w = c.warnings.join("\n");
        assert!(w.contains("cpu_model \"EPYC\" -> \"Xeon\""), "{w}");
        assert!(w.contains("kernel"), "{w}");
        assert!(w.contains("schema 1 -> 2: an incompatible change"), "{w}");
        assert_eq!(c.settings, ["runs: 3 -> 7"]);
        let text = render(&c, 5.0);
        assert!(
            text.starts_with("warning: ") && text.contains("- runs: 3 -> 7"),
            "{text}"
        );
    }

    #[test]
    fn all_file_recurses_by_key() {
        let v = sum(100.0, 99.0, 101.0);
        let cipher = json!({"machine": machine("EPYC"), "runs": 3,
            "results": [{"spec": "aes-xts-plain64", "key_bits": 512, "gbps": v}]});
        let engine = report("EPYC", v.clone(), v.clone());
        let host = json!({"cpu_model": "EPYC", "cores": 2, "cpu_mhz": [2400.1, 2399.9], "os": "Debian 12"});
        let old = json!({"schema": 1, "host": host, "started_utc": "08:00", "cipher": cipher, "engine": engine});
        let mut new = old.clone();
        new["engine"]["rows"][0]["value"] = sum(200.0, 199.0, 201.0);
        new["cipher"]["machine"]["cores"] = json!(4);
        new["host"]["cpu_mhz"] = json!([1800.0, 3000.0]);
        new["started_utc"] = json!("09:00");
        let c = run(&old, &new);
        let tables: std::collections::BTreeSet<&str> =
            c.deltas.iter().map(|d| d.table.as_str()).collect();
        assert_eq!(
            tables.into_iter().collect::<Vec<_>>(),
            ["cipher.results", "engine", "engine.rows"]
        );
        assert_eq!(find(&c, "raw", "value"), (Some(100.0), Verdict::Changed));
        assert_eq!(find(&c, "aes-xts", "gbps"), (Some(0.0), Verdict::Same));
        assert_eq!(c.warnings, ["cipher: different machines: cores 2 -> 4"]);
        assert_eq!(c.settings, [r#"started_utc: "08:00" -> "09:00""#]);
    }

    #[test]
    fn malformed_files_are_errors() {
        // (file, what the error says)
        let rows = [
            (json!([1, 2]), "expected a JSON object"),
            (
                json!({"machine": machine("x"), "runs": 3}),
                "no benchmark rows",
            ),
            (
                json!({"rows": [{"k": "a", "v": {"median": "fast", "min": 1, "max": 2}}]}),
                "rows[0].v.median: expected a number",
            ),
        ];
        for (v, want) in rows {
            let e = flatten(&v).expect_err("malformed");
            assert!(e.contains(want), "{v}: {e}");
        }
    }

    #[test]
    fn nan_medians_are_not_computable() {
        // serde_json writes a NaN median (a Summary of no runs) as null.
        let old = json!({"rows": [{"k": "a", "v": {"median": null, "min": null, "max": null, "runs": 0}}]});
        let new = json!({"rows": [{"k": "a", "v": sum(1.0, 1.0, 1.0)}]});
        let c = run(&old, &new);
        assert_eq!(find(&c, "a", "v"), (None, Verdict::Unknown));
        assert!(render(&c, 5.0).contains("n/a"));
    }
}
