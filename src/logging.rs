//! Log lines on stderr: plain, or with the journal's priority prefixes (`<3>` error, `<4>`
//! warning, `<6>` info, `<7>` debug) when `$JOURNAL_STREAM` says stderr is the journal, as it
//! is for a systemd unit.

use std::io::IsTerminal as _;
use std::os::fd::AsFd as _;

use tracing::Level;
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

/// Installs the log: `LOOPD_LOG` is the level (error, warn, info by default, debug or trace).
pub fn init() {
    let level = std::env::var("LOOPD_LOG")
        .ok()
        .and_then(|l| l.parse::<LevelFilter>().ok())
        .unwrap_or(LevelFilter::INFO);
    let fmt = tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .without_time()
        .with_target(false)
        .with_level(false);
    if stderr_is_journal() {
        let format = tracing_subscriber::fmt::format()
            .with_ansi(false)
            .without_time()
            .with_target(false)
            .with_level(false);
        fmt.event_format(Journald(format)).init();
    } else {
        fmt.init();
    }
}

/// `$JOURNAL_STREAM` is `DEVICE:INODE` of the stream connected to the journal.
fn stderr_is_journal() -> bool {
    let Some(stream) = std::env::var_os("JOURNAL_STREAM") else {
        return false;
    };
    let Ok(stat) = nix::sys::stat::fstat(std::io::stderr().as_fd()) else {
        return false;
    };
    stream.to_str() == Some(&format!("{}:{}", stat.st_dev, stat.st_ino))
}

/// The journal's priority of a level (syslog's numbers).
fn priority(level: &Level) -> u8 {
    match *level {
        Level::ERROR => 3,
        Level::WARN => 4,
        Level::INFO => 6,
        Level::DEBUG | Level::TRACE => 7,
    }
}

/// A format with the journal's priority prefix before each line.
struct Journald<F>(F);

impl<S, N, F> FormatEvent<S, N> for Journald<F>
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        write!(writer, "<{}>", priority(event.metadata().level()))?;
        self.0.format_event(ctx, writer, event)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_map_to_syslog_priorities() {
        assert_eq!(priority(&Level::ERROR), 3);
        assert_eq!(priority(&Level::WARN), 4);
        assert_eq!(priority(&Level::INFO), 6);
        assert_eq!(priority(&Level::DEBUG), 7);
    }
}
