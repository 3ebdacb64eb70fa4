//! `--progress-json`: cryptsetup's machine-readable progress (`src/utils_progress.c`,
//! `tools_time_progress_json`), one JSON object a line on standard output:
//!
//! `{"device":"/dev/sdb","device_bytes":"1048576","device_size":"8388608","speed":"52428800","eta_ms":"140","time_ms":"20"}`
//!
//! every number a decimal string, as cryptsetup prints them. The first report only starts the
//! clock; a line follows whenever `--progress-frequency` seconds (default half a second) have
//! passed since the last one, and always at the end (`device_bytes` equal to `device_size`,
//! `eta_ms` 0). `speed` counts the bytes since the first report per second.

use std::io::Write;
use std::time::{Duration, Instant};

/// cryptsetup's interval between lines without `--progress-frequency`.
const DEFAULT_EVERY: Duration = Duration::from_millis(500);

/// The JSON progress of one long operation on one device.
pub(crate) struct JsonProgress {
    device: String,
    every: Duration,
    /// When the first report came and how far the operation already was then.
    start: Option<(Instant, u64)>,
    last: Instant,
    /// The end's line was printed: a second report of the end prints nothing.
    ended: bool,
}

impl JsonProgress {
    /// `device` as cryptsetup names it (the data device); a line every `frequency_s`
    /// seconds, or every half second.
    pub(crate) fn new(device: String, frequency_s: Option<u64>) -> Self {
        JsonProgress {
            device,
            every: match frequency_s {
                Some(s) if s > 0 => Duration::from_secs(s),
                _ => DEFAULT_EVERY,
            },
            start: None,
            last: Instant::now(),
            ended: false,
        }
    }

    /// The operation has done `done` of `total` bytes: prints a line when one is due.
    pub(crate) fn report(&mut self, done: u64, total: u64) {
        if let Some(line) = self.line_at(Instant::now(), done, total) {
            let mut out = std::io::stdout().lock();
            // A closed standard output loses progress lines only; the operation goes on.
            let _ = out.write_all(line.as_bytes());
            let _ = out.flush();
        }
    }

    /// The line due at `now`, if one is (cryptsetup's `calculate_tdiff` rules).
    fn line_at(&mut self, now: Instant, done: u64, total: u64) -> Option<String> {
        let Some((start, first)) = self.start else {
            self.start = Some((now, done));
            self.last = now;
            return None;
        };
        let end = done == total;
        if self.ended || (!end && now.duration_since(self.last) < self.every) {
            return None;
        }
        self.last = now;
        let secs = now.duration_since(start).as_secs_f64();
        if secs == 0.0 {
            return None;
        }
        let speed = done.saturating_sub(first) as f64 / secs;
        let eta_ms = if end || speed <= 0.0 {
            0
        } else {
            // cryptsetup's estimate: the whole device at this speed, less the time spent.
            ((total as f64 / speed - secs) * 1e3).max(0.0) as u64
        };
        self.ended = end;
        let device = serde_json::Value::String(self.device.clone());
        Some(format!(
            "{{\"device\":{device},\"device_bytes\":\"{done}\",\"device_size\":\"{total}\",\
             \"speed\":\"{}\",\"eta_ms\":\"{eta_ms}\",\"time_ms\":\"{}\"}}\n",
            speed as u64,
            (secs * 1e3) as u64
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_follow_cryptsetups_clock() {
        let mut p = JsonProgress::new("/dev/x".into(), Some(1));
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        // The first report starts the clock.
        assert_eq!(p.line_at(at(0), 0, 4096), None);
        // Not yet a second since the last line.
        assert_eq!(p.line_at(at(500), 1024, 4096), None);
        assert_eq!(
            p.line_at(at(1000), 2048, 4096).as_deref(),
            Some(
                "{\"device\":\"/dev/x\",\"device_bytes\":\"2048\",\"device_size\":\"4096\",\
                 \"speed\":\"2048\",\"eta_ms\":\"1000\",\"time_ms\":\"1000\"}\n"
            )
        );
        // The end is always printed, with no time left.
        assert_eq!(
            p.line_at(at(1200), 4096, 4096).as_deref(),
            Some(
                "{\"device\":\"/dev/x\",\"device_bytes\":\"4096\",\"device_size\":\"4096\",\
                 \"speed\":\"3413\",\"eta_ms\":\"0\",\"time_ms\":\"1200\"}\n"
            )
        );
        assert_eq!(p.line_at(at(1300), 4096, 4096), None, "the end twice");
    }

    #[test]
    fn a_device_name_is_a_json_string() {
        let mut p = JsonProgress::new("/tmp/a \"b\"".into(), None);
        let t0 = Instant::now();
        p.line_at(t0, 0, 10);
        let line = p
            .line_at(t0 + Duration::from_secs(1), 10, 10)
            .expect("the end");
        let v: serde_json::Value = serde_json::from_str(&line).expect("JSON");
        assert_eq!(v["device"], "/tmp/a \"b\"");
    }
}
