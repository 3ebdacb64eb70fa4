//! `ucrypt bench all`: every scenario (cipher, engine, FUSE, NBD, vhost) in one run, written to a
//! results folder: `report.md` (tables, ratios, where the time went, the plots), `all.json`
//! (every scenario's JSON under its name; see docs/bench-json.md), one JSON per scenario, and
//! `plots/*.svg` + `plots/*.png`.
//!
//! Scenarios that cannot run here (a peer not installed, FUSE not mountable, no qemu or VM kit
//! for vhost) are reported as skipped with the reason; the others still run. Ratios are only meaningful within one run:
//! machines change their clock over minutes, so each scenario interleaves its targets.

use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use clap::Args;
use serde::Serialize;
use serde_json::Value;

use super::plot::{self, BarChart, BarSeries, BarValue, Legend, LineChart, Series};
use super::stats::Machine;
use super::{cipher, engine, fuse, nbd, vhost, Common};

/// The scenarios, in the order they run.
pub const SCENARIOS: [&str; 5] = ["cipher", "engine", "fuse", "nbd", "vhost"];

#[derive(Args, Clone)]
pub struct AllArgs {
    #[command(flatten)]
    common: Common,
    /// Results folder (default: bench-results/<UTC date-time> under the current directory).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Leave out these scenarios (comma-separated: cipher, engine, fuse, nbd, vhost).
    #[arg(long, value_delimiter = ',')]
    skip: Vec<String>,
}

/// What the numbers were measured on, with what a reader needs to weigh them.
#[derive(Debug, Clone, Serialize)]
pub struct Host {
    #[serde(flatten)]
    pub machine: Machine,
    pub os: String,
    pub memory_gib: f64,
    /// Current clock of each CPU as /proc/cpuinfo reports it at the start (MHz).
    pub cpu_mhz: Vec<f64>,
    pub clock_note: &'static str,
}

const CLOCK_NOTE: &str = "Virtual machines and power-managed CPUs change their clock over \
    minutes (30-50 % on this project's machine), and a shared host adds noise: compare the \
    ratios within one report, not absolute numbers across reports.";

impl Host {
    fn detect() -> Host {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu_mhz = cpuinfo
            .lines()
            .filter(|l| l.starts_with("cpu MHz"))
            .filter_map(|l| l.split_once(':')?.1.trim().parse().ok())
            .collect();
        let os = std::fs::read_to_string("/etc/os-release")
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("PRETTY_NAME="))
            .map(|v| v.trim_matches('"').to_string())
            .unwrap_or_default();
        let memory_gib = std::fs::read_to_string("/proc/meminfo")
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
            .map_or(0.0, |kb| kb / (1024.0 * 1024.0));
        Host {
            machine: Machine::detect(),
            os,
            memory_gib,
            cpu_mhz,
            clock_note: CLOCK_NOTE,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Skipped {
    pub scenario: String,
    pub reason: String,
}

/// `all.json`.
#[derive(Serialize)]
pub struct AllReport {
    /// Bumped on an incompatible change (see docs/bench-json.md).
    pub schema: u32,
    pub ucrypt_version: &'static str,
    pub command: String,
    pub started_utc: String,
    pub duration_s: f64,
    pub quick: bool,
    pub host: Host,
    /// Seconds each scenario took.
    pub timings: Vec<(String, f64)>,
    pub skipped: Vec<Skipped>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cipher: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub engine: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fuse: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nbd: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vhost: Option<Value>,
}

pub fn run(a: AllArgs) -> i32 {
    match run_all(&a) {
        Ok(dir) if a.common.json => match std::fs::read_to_string(dir.join("all.json")) {
            Ok(text) => {
                print!("{text}");
                0
            }
            Err(e) => {
                eprintln!("ucrypt bench all: reading back all.json: {e}");
                1
            }
        },
        Ok(dir) => {
            println!("{}", dir.join("report.md").display());
            0
        }
        Err(e) => {
            eprintln!("ucrypt bench all: {e}");
            1
        }
    }
}

fn run_all(a: &AllArgs) -> Result<PathBuf, String> {
    for s in &a.skip {
        if !SCENARIOS.contains(&s.as_str()) {
            return Err(format!(
                "--skip {s}: no such scenario (choose from {})",
                SCENARIOS.join(", ")
            ));
        }
    }
    let started = SystemTime::now();
    let stamp = utc_stamp(started);
    let dir = a
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from("bench-results").join(stamp.replace(':', "")));
    std::fs::create_dir_all(dir.join("plots"))
        .map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let c = a.common;
    let quick = c.quick;
    // The front-end scenarios run fio once per job, target and run (each a few seconds): fewer
    // runs than the in-process scenarios, so that the full run stays under 20 minutes.
    let fio_runs = match (c.runs, quick) {
        (Some(n), _) => n.max(1),
        (None, true) => 2,
        (None, false) => 5,
    };
    // vhost runs its fio jobs in an emulated guest, on four disks: a round takes several
    // minutes (main.rs's `Vhost`), so one round with --quick, two without.
    let vm_runs = match (c.runs, quick) {
        (Some(n), _) => n.max(1),
        (None, true) => 1,
        (None, false) => 2,
    };
    let t0 = Instant::now();
    let mut all = AllReport {
        schema: 1,
        ucrypt_version: env!("CARGO_PKG_VERSION"),
        command: std::env::args().collect::<Vec<_>>().join(" "),
        started_utc: stamp,
        duration_s: 0.0,
        quick,
        host: Host::detect(),
        timings: Vec::new(),
        skipped: Vec::new(),
        cipher: None,
        engine: None,
        fuse: None,
        nbd: None,
        vhost: None,
    };
    let mut md = Vec::new();
    let total = SCENARIOS
        .iter()
        .filter(|s| !a.skip.iter().any(|x| x == *s))
        .count();
    let mut n = 0;
    for name in SCENARIOS {
        if a.skip.iter().any(|s| s == name) {
            continue;
        }
        n += 1;
        eprintln!(
            "bench all: [{n}/{total}] {name} (elapsed {:.0} s)",
            t0.elapsed().as_secs_f64()
        );
        let ts = Instant::now();
        let r: Result<(Value, String), String> = match name {
            "cipher" => {
                let r = cipher::measure(c.runs(), quick, true, &[]);
                Ok((to_value(&r), cipher::markdown(&r)))
            }
            "engine" => {
                let r = engine::measure(c.runs(), quick, true, &[]);
                Ok((to_value(&r), engine::markdown(&r)))
            }
            "fuse" => {
                fuse::measure(fio_runs, quick, true).map(|r| (to_value(&r), fuse::markdown(&r)))
            }
            "nbd" => nbd::measure(fio_runs, quick, true).map(|r| (to_value(&r), nbd::markdown(&r))),
            _ => vhost::measure(vm_runs, quick, true).map(|r| (to_value(&r), vhost::markdown(&r))),
        };
        all.timings
            .push((name.to_string(), ts.elapsed().as_secs_f64()));
        match r {
            Ok((v, text)) => {
                write_json(&dir.join(format!("{name}.json")), &v)?;
                // Peers a scenario skipped (not installed) are listed with the scenario; a
                // scenario that measured nothing (vhost without qemu) says why as a string.
                for reason in skipped_reasons(&v) {
                    all.skipped.push(Skipped {
                        scenario: name.to_string(),
                        reason,
                    });
                }
                md.push((name, text));
                match name {
                    "cipher" => all.cipher = Some(v),
                    "engine" => all.engine = Some(v),
                    "fuse" => all.fuse = Some(v),
                    "nbd" => all.nbd = Some(v),
                    _ => all.vhost = Some(v),
                }
            }
            Err(e) => {
                eprintln!("bench all: {name} skipped: {e}");
                all.skipped.push(Skipped {
                    scenario: name.to_string(),
                    reason: e,
                });
            }
        }
    }
    all.duration_s = t0.elapsed().as_secs_f64();
    eprintln!("bench all: plots");
    let (plots, plot_notes) = draw_plots(&all, &dir.join("plots"));
    write_json(&dir.join("all.json"), &to_value(&all))?;
    let report = report_markdown(&all, &md, &plots, &plot_notes);
    std::fs::write(dir.join("report.md"), report)
        .map_err(|e| format!("writing {}: {e}", dir.join("report.md").display()))?;
    eprintln!(
        "bench all: done in {:.0} s; report in {}",
        all.duration_s,
        dir.display()
    );
    Ok(dir)
}

/// A report's `skipped`: a list of reasons (peers left out), or one reason (nothing measured).
fn skipped_reasons(report: &Value) -> Vec<String> {
    match report.get("skipped") {
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(Value::as_str)
            .map(str::to_string)
            .collect(),
        Some(Value::String(s)) => vec![s.clone()],
        _ => Vec::new(),
    }
}

fn to_value<T: Serialize>(r: &T) -> Value {
    serde_json::to_value(r).unwrap_or_else(|e| Value::String(format!("not serialisable: {e}")))
}

fn write_json(path: &Path, v: &Value) -> Result<(), String> {
    let text = serde_json::to_string_pretty(v).map_err(|e| e.to_string())?;
    std::fs::write(path, text + "\n").map_err(|e| format!("writing {}: {e}", path.display()))
}

/// `YYYY-MM-DDTHH:MM:SSZ` without a date crate (civil-from-days, proleptic Gregorian).
pub fn utc_stamp(t: SystemTime) -> String {
    let secs = t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()) as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

// ---------------------------------------------------------------- plots

/// A drawn plot: its title and file stem (relative to the results folder).
struct Drawn {
    title: String,
    stem: String,
}

fn num(v: &Value) -> Option<f64> {
    v.as_f64()
}

/// Engine rows of one scenario (prefix match) and backend.
fn engine_rows<'a>(all: &'a AllReport, scenario: &str) -> Vec<&'a Value> {
    let Some(rows) = all
        .engine
        .as_ref()
        .and_then(|e| e.get("rows"))
        .and_then(Value::as_array)
    else {
        return Vec::new();
    };
    let backend = rows
        .first()
        .and_then(|r| r.get("backend"))
        .cloned()
        .unwrap_or(Value::Null);
    rows.iter()
        .filter(|r| {
            r["scenario"]
                .as_str()
                .is_some_and(|s| s.starts_with(scenario))
                && r["backend"] == backend
        })
        .collect()
}

/// One line per variant: (x from `x_field`, median).
fn lines_by_variant(rows: &[&Value], x_field: &str, x_scale: f64) -> Vec<Series> {
    let mut out: Vec<Series> = Vec::new();
    for r in rows {
        let (Some(v), Some(x), Some(y)) = (
            r["variant"].as_str(),
            num(&r[x_field]),
            num(&r["value"]["median"]),
        ) else {
            continue;
        };
        let p = (x * x_scale, y);
        match out.iter_mut().find(|s| s.name == v) {
            Some(s) => s.points.push(p),
            None => out.push(Series {
                name: v.to_string(),
                points: vec![p],
            }),
        }
    }
    out
}

/// Grouped bars of a front-end report (rows with `job.name`, `target`, `mib_s`).
fn frontend_bars(title: &str, report: &Value) -> Option<BarChart> {
    let rows = report.get("rows")?.as_array()?;
    let mut groups: Vec<String> = Vec::new();
    let mut targets: Vec<String> = Vec::new();
    let target_name = |r: &Value| match &r["target"] {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    for r in rows {
        let g = r["job"]["name"].as_str()?.to_string();
        if !groups.contains(&g) {
            groups.push(g);
        }
        let t = target_name(r);
        if !targets.contains(&t) {
            targets.push(t);
        }
    }
    let series = targets
        .iter()
        .map(|t| BarSeries {
            name: t.clone(),
            values: groups
                .iter()
                .map(|g| {
                    rows.iter()
                        .find(|r| r["job"]["name"].as_str() == Some(g) && &target_name(r) == t)
                        .and_then(|r| {
                            Some(BarValue {
                                median: num(&r["mib_s"]["median"])?,
                                min: num(&r["mib_s"]["min"])?,
                                max: num(&r["mib_s"]["max"])?,
                            })
                        })
                })
                .collect(),
        })
        .collect();
    Some(BarChart {
        title: title.to_string(),
        y_label: "MiB/s".to_string(),
        groups,
        series,
    })
}

fn draw_plots(all: &AllReport, dir: &Path) -> (Vec<Drawn>, Vec<String>) {
    let mut drawn = Vec::new();
    let mut notes = Vec::new();
    let mut keep = |title: &str, stem: &str, r: Result<plot::Written, String>| match r {
        Ok(w) => {
            notes.extend(w.notes.into_iter().map(|n| format!("{stem}: {n}")));
            drawn.push(Drawn {
                title: title.to_string(),
                stem: format!("plots/{stem}"),
            });
        }
        Err(e) => notes.push(format!("{stem}: not drawn: {e}")),
    };
    for (dir_name, label) in [("reads", "reads"), ("writes", "writes")] {
        let rows = engine_rows(
            all,
            &format!("7. block size sweep, one stream of {dir_name}"),
        );
        if rows.is_empty() {
            continue;
        }
        let stem = format!("engine-block-size-{dir_name}");
        let title = format!("Throughput by block size and policy, one stream of {label}");
        let series = lines_by_variant(&rows, "block_bytes", 1.0);
        let chart = LineChart {
            title: title.clone(),
            x_label: "request size".into(),
            y_label: "MB/s".into(),
            log_x: true,
            log_y: false,
            x_ticks: plot::x_values(&series),
            x_bytes: true,
            legend: Legend::UpperLeft,
            series,
        };
        keep(&title, &stem, plot::line_chart(&chart, &dir.join(&stem)));
    }
    for (prefix, stem, title) in [
        (
            "5a.",
            "engine-latency-cdf-idle",
            "4 KiB random reads at QD1, idle CPUs: latency CDF",
        ),
        (
            "5.",
            "engine-latency-cdf-busy",
            "4 KiB random reads at QD1, 2 busy threads: latency CDF",
        ),
    ] {
        let rows = engine_rows(all, prefix);
        let series: Vec<(String, Vec<(f64, f64)>)> = rows
            .iter()
            .filter_map(|r| {
                let pts = r["cdf"]
                    .as_array()?
                    .iter()
                    .filter_map(|p| Some((num(&p[0])?, num(&p[1])?)))
                    .collect::<Vec<_>>();
                Some((r["variant"].as_str()?.to_string(), pts))
            })
            .filter(|(_, p)| !p.is_empty())
            .collect();
        if !series.is_empty() {
            keep(
                title,
                stem,
                plot::cdf_chart(title, &series, &dir.join(stem)),
            );
        }
    }
    let rows = engine_rows(all, "8. scaling with threads");
    if !rows.is_empty() {
        let title = "Scaling with threads, 64 KiB random read/write 2:1";
        let stem = "engine-threads";
        let series = lines_by_variant(&rows, "threads", 1.0);
        let chart = LineChart {
            title: title.into(),
            x_label: "threads".into(),
            y_label: "MB/s".into(),
            log_x: true,
            log_y: false,
            x_ticks: plot::x_values(&series),
            x_bytes: false,
            legend: Legend::UpperLeft,
            series,
        };
        keep(title, stem, plot::line_chart(&chart, &dir.join(stem)));
    }
    for (name, report, title) in [
        ("fuse", &all.fuse, "FUSE export, fio on the file (MiB/s)"),
        (
            "nbd",
            &all.nbd,
            "NBD server, fio nbd engine and qemu-img bench (MiB/s)",
        ),
    ] {
        if let Some(chart) = report.as_ref().and_then(|r| frontend_bars(title, r)) {
            keep(title, name, plot::bar_chart(&chart, &dir.join(name)));
        }
    }
    (drawn, notes)
}

// ---------------------------------------------------------------- report

fn report_markdown(
    all: &AllReport,
    sections: &[(&str, String)],
    plots: &[Drawn],
    plot_notes: &[String],
) -> String {
    let h = &all.host;
    let mut o = format!(
        "# ucrypt benchmark report\n\n\
         `{}` — ucrypt {}, started {}, took {:.0} s{}.\n\n\
         ## Machine\n\n\
         - CPU: {} ({} cores; AES-related flags: {}); clock now: {} MHz\n\
         - Memory: {:.1} GiB; OS: {}; kernel {}\n\
         - {}\n\n\
         Every scenario runs its targets side by side, interleaved round-robin; numbers are \
         medians with min–max over the runs.\n",
        all.command,
        all.ucrypt_version,
        all.started_utc,
        all.duration_s,
        if all.quick {
            " (--quick: fewer, shorter runs)"
        } else {
            ""
        },
        h.machine.cpu_model,
        h.machine.cores,
        h.machine.aes_flags.join(" "),
        h.cpu_mhz
            .iter()
            .map(|m| format!("{m:.0}"))
            .collect::<Vec<_>>()
            .join(", "),
        h.memory_gib,
        h.os,
        h.machine.kernel,
        h.clock_note,
    );
    o += &summary_table(all);
    if !all.skipped.is_empty() {
        o += "\n## Skipped\n\n";
        for s in &all.skipped {
            o += &format!("- {}: {}\n", s.scenario, s.reason);
        }
    }
    if !plots.is_empty() {
        o += "\n## Plots\n\n";
        for p in plots {
            o += &format!(
                "### {}\n\n![{}]({}.svg)\n\n(PNG: [{}.png]({}.png))\n\n",
                p.title, p.title, p.stem, p.stem, p.stem
            );
        }
        for n in plot_notes {
            o += &format!("- {n}\n");
        }
    }
    for (name, text) in sections {
        o += &format!("\n## Scenario: {name}\n\n");
        // Each scenario's own markdown uses `#` for its title: nest it one level deeper.
        for line in text.lines() {
            if line.starts_with('#') {
                o += "##";
            }
            o += line;
            o += "\n";
        }
    }
    o += "\n## Time per scenario\n\n| scenario | seconds |\n|---|---|\n";
    for (n, s) in &all.timings {
        o += &format!("| {n} | {s:.0} |\n");
    }
    o
}

/// One row per target of the briefs that this run checked: (check, measured, target, met).
fn summary_rows(all: &AllReport) -> Vec<(String, f64, f64, bool)> {
    let mut out = Vec::new();
    for (name, report) in [("engine", &all.engine), ("vhost", &all.vhost)] {
        let Some(ts) = report.as_ref().and_then(|e| e["targets"].as_array()) else {
            continue;
        };
        for t in ts {
            if let (Some(w), Some(m), Some(g), Some(ok)) = (
                t["what"].as_str(),
                num(&t["measured"]),
                num(&t["target"]),
                t["met"].as_bool(),
            ) {
                out.push((format!("{name}: {w}"), m, g, ok));
            }
        }
    }
    if let Some(gs) = all.nbd.as_ref().and_then(|e| e["goals"].as_array()) {
        for g in gs {
            if let (Some(job), Some(r), Some(min)) =
                (g["job"].as_str(), num(&g["ratio"]), num(&g["min_ratio"]))
            {
                let name = |v: &Value| match v {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                out.push((
                    format!("nbd: {job}: {} ÷ {}", name(&g["ours"]), name(&g["peer"])),
                    r,
                    min,
                    r >= min,
                ));
            }
        }
    }
    if let Some(rows) = all.fuse.as_ref().and_then(|f| f["rows"].as_array()) {
        let target = |r: &Value| r["target"].as_str().unwrap_or_default().to_string();
        for peer in rows.iter().filter(|r| target(r) == "QemuStorageDaemon") {
            let job = &peer["job"]["name"];
            for ours in rows
                .iter()
                .filter(|r| &r["job"]["name"] == job && target(r).starts_with("Ucrypt"))
            {
                if let (Some(a), Some(b)) =
                    (num(&ours["mib_s"]["median"]), num(&peer["mib_s"]["median"]))
                {
                    let r = a / b;
                    out.push((
                        format!(
                            "fuse: {}: {} ÷ qemu-storage-daemon",
                            job.as_str().unwrap_or_default(),
                            target(ours)
                        ),
                        r,
                        2.0,
                        r >= 2.0,
                    ));
                }
            }
        }
    }
    out
}

fn summary_table(all: &AllReport) -> String {
    let rows = summary_rows(all);
    if rows.is_empty() {
        return String::new();
    }
    let met = rows.iter().filter(|r| r.3).count();
    let mut o = format!(
        "\n## Targets: {met} of {} met\n\n| check | measured | target | |\n|---|---|---|---|\n",
        rows.len()
    );
    for (what, m, g, ok) in rows {
        o += &format!(
            "| {what} | {m:.2} | ≥ {g:.2} | {} |\n",
            if ok { "met" } else { "MISSED" }
        );
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_stamps() {
        // (seconds since the epoch, expected)
        let rows: &[(u64, &str)] = &[
            (0, "1970-01-01T00:00:00Z"),
            (951_782_400, "2000-02-29T00:00:00Z"),
            (1_795_332_245, "2026-11-22T07:24:05Z"),
            (4_107_542_399, "2100-02-28T23:59:59Z"),
        ];
        for (secs, want) in rows {
            let t = UNIX_EPOCH + std::time::Duration::from_secs(*secs);
            assert_eq!(utc_stamp(t), *want, "{secs}");
        }
    }

    #[test]
    fn frontend_bars_group_by_job_and_target() {
        let v: Value = serde_json::json!({"rows": [
            {"job": {"name": "4k read"}, "target": "Ucrypt", "mib_s": {"median": 3.0, "min": 2.0, "max": 4.0}},
            {"job": {"name": "4k read"}, "target": "Plain", "mib_s": {"median": 5.0, "min": 5.0, "max": 5.0}},
            {"job": {"name": "1M write"}, "target": "Ucrypt", "mib_s": {"median": 9.0, "min": 8.0, "max": 9.5}}
        ]});
        let c = frontend_bars("t", &v).unwrap();
        assert_eq!(c.groups, vec!["4k read", "1M write"]);
        assert_eq!(c.series.len(), 2);
        assert_eq!(c.series[0].name, "Ucrypt");
        assert_eq!(c.series[0].values[1].unwrap().median, 9.0);
        assert!(
            c.series[1].values[1].is_none(),
            "Plain did not run 1M write"
        );
    }

    /// Both shapes of a report's `skipped` reach the report's list.
    #[test]
    fn skipped_reasons_of_both_shapes() {
        let list = serde_json::json!({"skipped": ["nbdkit: not installed", 3]});
        assert_eq!(skipped_reasons(&list), ["nbdkit: not installed"]);
        let one = serde_json::json!({"skipped": "qemu-system-x86_64 not found"});
        assert_eq!(skipped_reasons(&one), ["qemu-system-x86_64 not found"]);
        assert!(skipped_reasons(&serde_json::json!({"skipped": null})).is_empty());
        assert!(skipped_reasons(&serde_json::json!({})).is_empty());
    }

    #[test]
    fn lines_by_variant_scale_x() {
        let rows = [
            serde_json::json!({"variant": "inline", "block_bytes": 4096, "value": {"median": 1.0}}),
            serde_json::json!({"variant": "inline", "block_bytes": 8192, "value": {"median": 2.0}}),
            serde_json::json!({"variant": "raw", "block_bytes": 4096, "value": {"median": 3.0}}),
        ];
        let refs: Vec<&Value> = rows.iter().collect();
        let s = lines_by_variant(&refs, "block_bytes", 1.0 / 1024.0);
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].points, vec![(4.0, 1.0), (8.0, 2.0)]);
    }
}
