//! The timeline: a Chrome-trace JSON file (chrome://tracing, Perfetto) of what the engine did
//! with each tensor. As in Horovod each tensor name is a "process" of the trace, and its
//! activities (negotiation, waiting in the response queue, fusion copies, the collective) are
//! begin/end pairs on it. The engine thread only timestamps events and appends them to a
//! buffer; a writer thread wakes a few times a second to format and write what piled up.
//! (Waking the writer for every event cost more than the collectives it was recording: a
//! thread wake-up is 40-60 µs on these machines, and a step can have hundreds of events.)

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;

use crate::error::{Error, Result};

/// How often the writer wakes to write what was recorded: the engine never wakes it (that
/// would cost its loop a futex call per event), so this bounds how stale the file is.
const WRITER_POLL: Duration = Duration::from_millis(20);

enum Event {
    Begin {
        tensor: String,
        activity: &'static str,
        at: Instant,
    },
    End {
        tensor: String,
        at: Instant,
        args: Option<String>,
    },
    Mark {
        name: &'static str,
        at: Instant,
    },
}

/// A running timeline; dropping it (or [`Timeline::stop`]) finishes the file.
pub struct Timeline {
    buffer: Arc<Mutex<Vec<Event>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    /// Whether cycle marks are wanted.
    pub mark_cycles: bool,
}

impl Timeline {
    /// Creates `path` and starts the writer.
    pub fn start(path: &str, mark_cycles: bool) -> Result<Timeline> {
        let file = File::create(path).map_err(|e| {
            Error::InvalidArgument(format!("cannot write the timeline {path:?}: {e}"))
        })?;
        let buffer: Arc<Mutex<Vec<Event>>> = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (events, stopping) = (buffer.clone(), stop.clone());
        let origin = Instant::now();
        let epoch_us = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_micros());
        let thread = std::thread::Builder::new()
            .name("ferrovod-timeline".into())
            .spawn(move || {
                let mut out = BufWriter::new(file);
                let mut pids: HashMap<String, usize> = HashMap::new();
                let _ = write!(
                    out,
                    "[\n{{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":0,\"args\":{{\"name\":\"ferrovod\",\"start_time_since_epoch_in_micros\":{epoch_us}}}}},\n\
                     {{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":0,\"args\":{{\"sort_index\":0}}}}"
                );
                let ts = |at: Instant| at.saturating_duration_since(origin).as_micros();
                let mut batch: Vec<Event> = Vec::new();
                loop {
                    let last = stopping.load(Ordering::Acquire);
                    std::mem::swap(&mut batch, &mut *events.lock());
                    let wrote = !batch.is_empty();
                    for ev in batch.drain(..) {
                    let mut pid_of = |tensor: &str, out: &mut BufWriter<File>| -> usize {
                        if let Some(&p) = pids.get(tensor) {
                            return p;
                        }
                        let p = pids.len() + 1;
                        pids.insert(tensor.to_string(), p);
                        let _ = write!(
                            out,
                            ",\n{{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":{p},\"args\":{{\"name\":{}}}}},\n\
                             {{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":{p},\"args\":{{\"sort_index\":{p}}}}}",
                            json_string(tensor)
                        );
                        p
                    };
                    let _ = match ev {
                        Event::Begin { tensor, activity, at } => {
                            let p = pid_of(&tensor, &mut out);
                            write!(out, ",\n{{\"name\":\"{activity}\",\"ph\":\"B\",\"ts\":{},\"pid\":{p},\"tid\":0}}", ts(at))
                        }
                        Event::End { tensor, at, args } => {
                            let p = pid_of(&tensor, &mut out);
                            match args {
                                Some(a) => write!(out, ",\n{{\"ph\":\"E\",\"ts\":{},\"pid\":{p},\"tid\":0,\"args\":{a}}}", ts(at)),
                                None => write!(out, ",\n{{\"ph\":\"E\",\"ts\":{},\"pid\":{p},\"tid\":0}}", ts(at)),
                            }
                        }
                        Event::Mark { name, at } => write!(
                            out,
                            ",\n{{\"name\":\"{name}\",\"ph\":\"i\",\"ts\":{},\"pid\":0,\"tid\":0,\"s\":\"g\"}}",
                            ts(at)
                        ),
                    };
                    }
                    if last {
                        break;
                    }
                    // The file is read while the job runs (and after a crash), as Horovod's
                    // is: what a batch wrote goes out with it, not when 8 KiB have piled up.
                    if wrote {
                        let _ = out.flush();
                    }
                    std::thread::park_timeout(WRITER_POLL);
                }
                let _ = writeln!(out, "\n]");
                let _ = out.flush();
            })
            .map_err(|e| Error::Io(format!("spawning the timeline writer: {e}")))?;
        Ok(Timeline {
            buffer,
            stop,
            thread: Some(thread),
            mark_cycles,
        })
    }

    fn send(&self, ev: Event) {
        self.buffer.lock().push(ev);
    }

    /// `activity` of `tensor` starts now.
    pub fn begin(&self, tensor: &str, activity: &'static str) {
        self.send(Event::Begin {
            tensor: tensor.to_string(),
            activity,
            at: Instant::now(),
        });
    }

    /// The innermost open activity of `tensor` ends now; `args` is a JSON object or `None`.
    pub fn end(&self, tensor: &str, args: Option<String>) {
        self.send(Event::End {
            tensor: tensor.to_string(),
            at: Instant::now(),
            args,
        });
    }

    /// An instant event (cycle marks).
    pub fn mark(&self, name: &'static str) {
        self.send(Event::Mark {
            name,
            at: Instant::now(),
        });
    }

    /// Writes what is queued, closes the JSON array and the file.
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

impl Drop for Timeline {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The negotiation activity of an op kind, as Horovod names it.
pub fn negotiate_activity(kind: crate::types::OpKind) -> &'static str {
    use crate::types::OpKind::*;
    match kind {
        Allreduce => "NEGOTIATE_ALLREDUCE",
        Allgather => "NEGOTIATE_ALLGATHER",
        Broadcast => "NEGOTIATE_BROADCAST",
        Alltoall => "NEGOTIATE_ALLTOALL",
        Reducescatter => "NEGOTIATE_REDUCESCATTER",
        Barrier => "NEGOTIATE_BARRIER",
        Join => "NEGOTIATE_JOIN",
    }
}

/// The transfer activity of an op kind (the collective itself, over TCP).
pub fn transfer_activity(kind: crate::types::OpKind) -> &'static str {
    use crate::types::OpKind::*;
    match kind {
        Allreduce => "TCP_ALLREDUCE",
        Allgather => "TCP_ALLGATHER",
        Broadcast => "TCP_BCAST",
        Alltoall => "TCP_ALLTOALL",
        Reducescatter => "TCP_REDUCESCATTER",
        Barrier => "TCP_BARRIER",
        Join => "JOIN",
    }
}

/// A JSON string literal for `s` (tensor names are user text: quotes, backslashes and control
/// characters must be escaped).
pub fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_names() {
        assert_eq!(json_string("a\"b\\c\nd\u{1}"), "\"a\\\"b\\\\c\\nd\\u0001\"");
    }

    #[test]
    fn writes_a_well_formed_trace() {
        let dir = std::env::temp_dir().join(format!("fv-timeline-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.json");
        let mut t = Timeline::start(path.to_str().unwrap(), true).unwrap();
        t.begin("grad \"w\"", "NEGOTIATE_ALLREDUCE");
        t.end("grad \"w\"", None);
        t.mark("CYCLE_START");
        t.begin("grad \"w\"", "ALLREDUCE");
        t.end("grad \"w\"", Some("{\"dtype\":\"float32\"}".into()));
        t.stop();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.starts_with("[\n") && text.trim_end().ends_with(']'));
        assert_eq!(text.matches("\"ph\":\"B\"").count(), 2);
        assert_eq!(text.matches("\"ph\":\"E\"").count(), 2);
        assert!(text.contains("\"name\":\"grad \\\"w\\\"\""));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
