//! The one parser for durations ("250ms", "2s") and sizes ("64KiB") in the config.
//!
//! Both are written as strings so that a file always says its unit. Each has a
//! `serde(with = ...)` module that reads and writes the same form, so the
//! effective config printed by `herdguard check` can be read back.

pub mod clock;

use std::time::Duration;

use serde::{de, Deserialize, Deserializer, Serializer};

/// The longest duration any key takes: a day. Every sum and product the
/// proxy makes of durations (attempts × per-try time, backoff ceilings,
/// doubled open times, a clock reading plus a timeout) stays far from
/// overflowing below it.
pub const MAX_DURATION: Duration = Duration::from_secs(24 * 3600);

/// The largest size any key takes: 1 TiB.
pub const MAX_SIZE: u64 = 1 << 40;

/// Parses a duration such as `"250ms"`, `"2s"` or `"1m 30s"`, at most [`MAX_DURATION`].
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(text.trim())
        .map_err(|_| format!("{text:?} is not a duration (try \"250ms\", \"2s\" or \"1m\")"))?;
    if d > MAX_DURATION {
        return Err(format!("{text:?} is longer than the longest allowed, 1d"));
    }
    Ok(d)
}

/// Writes a duration the way `parse_duration` reads it back.
pub fn format_duration(d: Duration) -> String {
    humantime::format_duration(d).to_string().replace(' ', "")
}

/// Parses a size such as `"64KiB"`, `"1MiB"` or `"512"` (bytes), at most [`MAX_SIZE`].
pub fn parse_size(text: &str) -> Result<u64, String> {
    let n = text
        .trim()
        .parse::<bytesize::ByteSize>()
        .map(|b| b.as_u64())
        .map_err(|_| format!("{text:?} is not a size (try \"64KiB\" or \"1MiB\")"))?;
    if n > MAX_SIZE {
        return Err(format!("{text:?} is larger than the largest allowed, 1TiB"));
    }
    Ok(n)
}

/// Writes a size in the largest binary unit that divides it exactly.
pub fn format_size(bytes: u64) -> String {
    const UNITS: [(&str, u64); 3] = [("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
    for (unit, factor) in UNITS {
        if bytes >= factor && bytes.is_multiple_of(factor) {
            return format!("{}{unit}", bytes / factor);
        }
    }
    format!("{bytes}B")
}

/// A count of one or more, as a command-line value.
pub fn at_least_one<T>(text: &str) -> Result<T, String>
where
    T: std::str::FromStr + Default + PartialEq,
    T::Err: std::fmt::Display,
{
    match text.parse::<T>() {
        Ok(n) if n == T::default() => Err("must be at least 1".to_owned()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

pub mod duration {
    use super::*;

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format_duration(*d))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let text = String::deserialize(d)?;
        parse_duration(&text).map_err(de::Error::custom)
    }
}

/// An optional duration: absent means off.
pub mod duration_opt {
    use super::*;

    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.serialize_str(&format_duration(*d)),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        let text = String::deserialize(d)?;
        parse_duration(&text).map(Some).map_err(de::Error::custom)
    }
}

pub mod size {
    use super::*;

    pub fn serialize<S: Serializer>(n: &u64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format_size(*n))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        let text = String::deserialize(d)?;
        parse_size(&text).map_err(de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_round_trip() {
        for text in ["250ms", "2s", "1m", "1h", "1m30s", "10s"] {
            let d = parse_duration(text).unwrap();
            assert_eq!(parse_duration(&format_duration(d)).unwrap(), d, "{text}");
        }
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        let err = parse_duration("ten seconds").unwrap_err();
        assert!(err.contains("not a duration"), "{err}");
        assert_eq!(parse_duration("1d").unwrap(), MAX_DURATION);
        for absurd in ["25h", "500000000000y", "18446744073709551615s"] {
            let err = parse_duration(absurd).unwrap_err();
            assert!(
                err.contains("longest") || err.contains("not a duration"),
                "{absurd}: {err}"
            );
        }
    }

    #[test]
    fn sizes_round_trip() {
        assert_eq!(parse_size("64KiB").unwrap(), 64 * 1024);
        assert_eq!(parse_size("1MiB").unwrap(), 1 << 20);
        assert_eq!(parse_size("512").unwrap(), 512);
        assert_eq!(format_size(64 * 1024), "64KiB");
        assert_eq!(format_size(1 << 20), "1MiB");
        assert_eq!(format_size(1000), "1000B");
        assert_eq!(parse_size(&format_size(1000)).unwrap(), 1000);
        assert!(parse_size("lots").is_err());
        assert!(parse_size("2TiB").unwrap_err().contains("largest"));
    }
}
