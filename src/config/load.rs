//! Reading a config file: parse, inherit defaults, deserialize section by
//! section, validate, and name the key path and line of every error.
//!
//! Inheritance is done on the parsed TOML tree, before deserialization: each
//! route's `retry` and `breaker` tables are filled, key by key and table by
//! table, from `[defaults.retry]` and `[defaults.breaker]`. Inherited values
//! keep their source position, so an error in one points at the line where it
//! is written.

use std::fmt;
use std::ops::Range;
use std::path::Path;

use serde::de::DeserializeOwned;
use toml::de::{DeTable, DeValue, ValueDeserializer};
use toml::Spanned;

use super::schema::{Config, Defaults, RouteConfig, UpstreamConfig};
use super::validate;
use super::validated::{CompiledRoute, Validated};

/// One problem in a config file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// Where, as a key path: `routes[2].retry.backoff.cap`.
    pub path: KeyPath,
    /// 1-based line in the file, when known.
    pub line: Option<usize>,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.path.is_empty(), self.line) {
            (true, Some(line)) => write!(f, "line {line}: {}", self.message),
            (true, None) => f.write_str(&self.message),
            (false, Some(line)) => write!(f, "{} (line {line}): {}", self.path, self.message),
            (false, None) => write!(f, "{}: {}", self.path, self.message),
        }
    }
}

/// Every problem found in a config file, in file order.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

/// Why a config could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: invalid config:\n{errors}")]
    Invalid { path: String, errors: ConfigErrors },
}

/// A key path into the config, such as `routes[2].retry.backoff.cap`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyPath(Vec<Segment>);

#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Key(String),
    Index(usize),
}

impl KeyPath {
    pub fn root() -> Self {
        Self::default()
    }

    pub fn key(&self, key: impl Into<String>) -> Self {
        let mut p = self.clone();
        p.0.push(Segment::Key(key.into()));
        p
    }

    pub fn index(&self, index: usize) -> Self {
        let mut p = self.clone();
        p.0.push(Segment::Index(index));
        p
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// `routes[i]...` with `i` taken as a position in `index` (the routes
    /// that parsed) and given back as the route's index in the file.
    fn route_in_file(mut self, index: &[usize]) -> Self {
        if let [Segment::Key(routes), Segment::Index(i), ..] = &mut self.0[..] {
            if routes == "routes" {
                if let Some(&in_file) = index.get(*i) {
                    *i = in_file;
                }
            }
        }
        self
    }

    /// The segments of this path below `prefix` (all, if it is not one).
    fn below(&self, prefix: &KeyPath) -> &[Segment] {
        match self.0.strip_prefix(&prefix.0[..]) {
            Some(rest) => rest,
            None => &self.0,
        }
    }

    fn extend_from(&self, path: &serde_path_to_error::Path) -> Self {
        use serde_path_to_error::Segment as S;
        let mut p = self.clone();
        for seg in path.iter() {
            match seg {
                S::Seq { index } => p.0.push(Segment::Index(*index)),
                S::Map { key } => p.0.push(Segment::Key(key.clone())),
                S::Enum { variant } => p.0.push(Segment::Key(variant.clone())),
                S::Unknown => {}
            }
        }
        p
    }
}

impl fmt::Display for KeyPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, seg) in self.0.iter().enumerate() {
            match seg {
                Segment::Index(n) => write!(f, "[{n}]")?,
                Segment::Key(k) => {
                    if i > 0 {
                        f.write_str(".")?;
                    }
                    let bare = !k.is_empty()
                        && k.bytes()
                            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
                    if bare {
                        f.write_str(k)?;
                    } else {
                        write!(f, "{k:?}")?;
                    }
                }
            }
        }
        Ok(())
    }
}

/// A valid config, and what in it is allowed but probably not meant.
#[derive(Debug)]
pub struct Checked {
    pub validated: Validated,
    pub warnings: Vec<ConfigError>,
}

impl Config {
    /// Reads and validates a config file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Config, LoadError> {
        Config::check_file(path).map(|c| c.validated.into_config())
    }

    /// Reads and validates a config file, keeping the warnings.
    pub fn check_file(path: impl AsRef<Path>) -> Result<Checked, LoadError> {
        Config::check_file_with(path.as_ref(), true)
    }

    /// [`check_file`](Self::check_file) for a reload: the files
    /// `listen.tls` names are not read (a reload keeps the running TLS
    /// settings, and follows the files on its own).
    pub fn check_file_for_reload(path: impl AsRef<Path>) -> Result<Checked, LoadError> {
        Config::check_file_with(path.as_ref(), false)
    }

    fn check_file_with(path: &Path, tls_files: bool) -> Result<Checked, LoadError> {
        let display = path.display().to_string();
        let src = read_bounded(path).map_err(|source| LoadError::Read {
            path: display.clone(),
            source,
        })?;
        Config::check_str_with(&src, tls_files).map_err(|errors| LoadError::Invalid {
            path: display,
            errors,
        })
    }

    /// Parses and validates config text, reporting every error found.
    pub fn parse(src: &str) -> Result<Config, ConfigErrors> {
        Config::check_str(src).map(|c| c.validated.into_config())
    }

    /// Parses and validates config text, keeping the warnings.
    pub fn check_str(src: &str) -> Result<Checked, ConfigErrors> {
        Config::check_str_with(src, true)
    }

    fn check_str_with(src: &str, tls_files: bool) -> Result<Checked, ConfigErrors> {
        let mut root = DeTable::parse(src).map_err(|e| {
            ConfigErrors(vec![ConfigError {
                path: KeyPath::root(),
                line: e.span().map(|s| Lines::new(src).of(s.start)),
                message: e.message().trim().to_owned(),
            }])
        })?;
        inherit_defaults(root.get_mut());
        let lines = Lines::new(src);
        let mut loader = Loader {
            lines: &lines,
            tree: &root,
            errors: Vec::new(),
            route_index: Vec::new(),
            unparsed_upstreams: Default::default(),
        };
        let config = loader.sections();
        let unparsed = std::mem::take(&mut loader.unparsed_upstreams);
        let mut report = |path: KeyPath, message| {
            // `routes[i]` counts the routes that parsed: name the file's.
            let path = path.route_in_file(&loader.route_index);
            loader.error(path, None, message)
        };
        let compiled = validate::validate(&config, &unparsed, &mut report);
        if tls_files {
            validate::tls_files(&config, &mut report);
        }
        let routes = compiled_or(compiled, loader.errors)?;
        let mut warnings = Vec::new();
        validate::warnings(&config, &mut |path, message| {
            let span = locate(&root, &path);
            warnings.push(ConfigError {
                line: span.map(|s| lines.of(s.start)),
                path,
                message,
            })
        });
        Ok(Checked {
            validated: Validated::new(config, routes),
            warnings: tidy(warnings),
        })
    }
}

/// Every route's compiled policies, or the errors reported. A route with
/// no compiled policies and no error to say why would be a bug of the
/// checks: reported as one, never passed on.
pub(super) fn compiled_or(
    compiled: Vec<Option<CompiledRoute>>,
    errors: Vec<ConfigError>,
) -> Result<Vec<CompiledRoute>, ConfigErrors> {
    if !errors.is_empty() {
        return Err(ConfigErrors(tidy(errors)));
    }
    compiled
        .into_iter()
        .enumerate()
        .map(|(i, route)| {
            route.ok_or_else(|| {
                ConfigErrors(vec![ConfigError {
                    path: KeyPath::root().key("routes").index(i),
                    line: None,
                    message: "did not compile, and no check said why (a bug: please report it)"
                        .into(),
                }])
            })
        })
        .collect()
}

/// The largest config file read: what a Kubernetes ConfigMap holds, and
/// several times the largest config the route bounds allow (1,000 routes
/// with every policy written out). A larger "file" (`/dev/zero`, a log
/// named by mistake) is refused before it fills memory: parsing costs
/// several times the file's size.
pub const MAX_CONFIG_BYTES: u64 = 1024 * 1024;

fn read_bounded(path: &Path) -> std::io::Result<String> {
    let bytes = super::files::read_bounded(path, MAX_CONFIG_BYTES)
        .map_err(|e| std::io::Error::other(format!("{e}; is this the config file?")))?;
    String::from_utf8(bytes).map_err(|_| std::io::Error::other("is not UTF-8 text"))
}

/// Reports an inherited value once, not once per route, in file order.
fn tidy(mut errors: Vec<ConfigError>) -> Vec<ConfigError> {
    // The same key of `[defaults]` and of every route that inherits it:
    // one report. Two keys on one line (an inline table) are two.
    let key = |e: &ConfigError| {
        let path = e.path.to_string();
        if let Some(inherited) = path.strip_prefix("defaults.") {
            return inherited.to_owned();
        }
        match path.strip_prefix("routes[") {
            Some(rest) => rest
                .split_once("].")
                .map_or(path.clone(), |(_, key)| key.to_owned()),
            None => path,
        }
    };
    let mut seen = std::collections::HashSet::new();
    errors.retain(|e| e.line.is_none() || seen.insert((e.line, key(e), e.message.clone())));
    errors.sort_by_key(|e| e.line.unwrap_or(usize::MAX));
    errors
}

struct Loader<'a, 'i> {
    lines: &'a Lines,
    tree: &'a Spanned<DeTable<'i>>,
    errors: Vec<ConfigError>,
    /// For each route that parsed, its index in the file.
    route_index: Vec<usize>,
    /// Upstreams the file names that did not parse.
    unparsed_upstreams: std::collections::BTreeSet<String>,
}

impl<'i> Loader<'_, 'i> {
    fn sections(&mut self) -> Config {
        let mut config = Config::default();
        let root = KeyPath::root();
        for (key, value) in self.tree.get_ref().iter() {
            let key = key.get_ref().as_ref();
            let path = root.key(key);
            match key {
                "listen" => {
                    if let Some(v) = self.section(value, &path) {
                        config.listen = v;
                    }
                }
                "admin" => {
                    if let Some(v) = self.section(value, &path) {
                        config.admin = v;
                    }
                }
                "access_log" => {
                    if let Some(v) = self.section(value, &path) {
                        config.access_log = v;
                    }
                }
                "defaults" => {
                    if let Some(v) = self.section::<Defaults>(value, &path) {
                        config.defaults = v;
                    }
                }
                "dns" => {
                    if let Some(v) = self.section(value, &path) {
                        config.dns = v;
                    }
                }
                "metrics" => {
                    if let Some(v) = self.section(value, &path) {
                        config.metrics = v;
                    }
                }
                "request_id" => {
                    if let Some(v) = self.section(value, &path) {
                        config.request_id = v;
                    }
                }
                "tracing" => {
                    if let Some(v) = self.section(value, &path) {
                        config.tracing = v;
                    }
                }
                "upstreams" => match value.get_ref() {
                    DeValue::Table(table) => {
                        for (name, upstream) in table.iter() {
                            let name = name.get_ref().to_string();
                            let path = path.key(name.clone());
                            match self.section::<UpstreamConfig>(upstream, &path) {
                                Some(v) => {
                                    config.upstreams.insert(name, v);
                                }
                                None => {
                                    self.unparsed_upstreams.insert(name);
                                }
                            }
                        }
                    }
                    _ => self.error(path, Some(value.span()), "must be a table of upstreams"),
                },
                "routes" => match value.get_ref() {
                    DeValue::Array(routes) => {
                        for (i, route) in routes.iter().enumerate() {
                            if let Some(v) = self.section::<RouteConfig>(route, &path.index(i)) {
                                config.routes.push(v);
                                self.route_index.push(i);
                            }
                        }
                    }
                    _ => self.error(path, Some(value.span()), "must be an array of [[routes]]"),
                },
                other => self.error(
                    path,
                    Some(value.span()),
                    format!(
                        "unknown key {other:?} (expected listen, admin, access_log, metrics, request_id, tracing, dns, upstreams, defaults or routes)"
                    ),
                ),
            }
        }
        config
    }

    /// Deserializes one section, reporting every error in it. serde stops
    /// at a section's first error, so after one, each value of the section
    /// is tried alone (a missing required key then is no error of its own);
    /// then the values in error are left out and the rest deserialized
    /// again, so that what they hid (a route's other keys, an upstream's
    /// endpoints) is still checked. `None` only when no repair serves (a
    /// required key is missing or wrong, or the section is no table).
    fn section<T: DeserializeOwned>(
        &mut self,
        value: &Spanned<DeValue<'i>>,
        path: &KeyPath,
    ) -> Option<T> {
        let mut tree = value.clone();
        let mut found: Vec<SectionError> = Vec::new();
        // Each pass leaves out at least one more key; a section has few.
        let parsed = loop {
            let first = match try_section::<T>(tree.clone(), path) {
                Ok(v) => break Some(v),
                Err(e) => e,
            };
            let mut errors = vec![first];
            let mut leaves = Vec::new();
            one_value_trees(&tree, &mut Vec::new(), &mut leaves);
            for leaf in leaves {
                if let Err(e) = try_section::<T>(leaf, path) {
                    if !e.2.starts_with("missing field") && !errors.contains(&e) {
                        errors.push(e);
                    }
                }
            }
            let mut repaired = false;
            for e in errors {
                let below = e.0.below(path);
                repaired |= leave_out(&mut tree, below);
                if !found.contains(&e) {
                    found.push(e);
                }
            }
            if !repaired {
                break None;
            }
        };
        for (path, span, message) in found {
            self.error(path, span, message);
        }
        parsed
    }

    fn error(&mut self, path: KeyPath, span: Option<Range<usize>>, message: impl Into<String>) {
        let span = span.or_else(|| locate(self.tree, &path));
        self.errors.push(ConfigError {
            line: span.map(|s| self.lines.of(s.start)),
            path,
            message: message.into(),
        });
    }
}

/// A section's first error: where, the span, what.
type SectionError = (KeyPath, Option<Range<usize>>, String);

fn try_section<T: DeserializeOwned>(
    value: Spanned<DeValue<'_>>,
    path: &KeyPath,
) -> Result<T, SectionError> {
    serde_path_to_error::deserialize::<_, T>(ValueDeserializer::from(value)).map_err(|e| {
        let path = path.extend_from(e.path());
        let inner = e.into_inner();
        (path, inner.span(), inner.message().trim().to_owned())
    })
}

/// Removes the key `path` leads to from `tree` (for a path into an array,
/// the key holding the array); false if there is no such key.
fn leave_out(tree: &mut Spanned<DeValue<'_>>, path: &[Segment]) -> bool {
    let Some((Segment::Key(key), rest)) = path.split_first() else {
        return false;
    };
    let DeValue::Table(table) = tree.get_mut() else {
        return false;
    };
    if let (Some(Segment::Key(_)), Some(inner)) = (rest.first(), table.get_mut(key.as_str())) {
        if leave_out(inner, rest) {
            return true;
        }
    }
    table.remove(key.as_str()).is_some()
}

/// For each value in `value`'s tables (an array or a scalar is one value),
/// a copy of `value` holding that value alone, at its place.
fn one_value_trees<'i>(
    value: &Spanned<DeValue<'i>>,
    above: &mut Vec<(Spanned<toml::de::DeString<'i>>, Range<usize>)>,
    out: &mut Vec<Spanned<DeValue<'i>>>,
) {
    let DeValue::Table(table) = value.get_ref() else {
        // Rebuild the tables above, innermost first, around this one value.
        let mut tree = value.clone();
        for (key, span) in above.iter().rev() {
            let mut t = DeTable::new();
            t.insert(key.clone(), tree);
            tree = Spanned::new(span.clone(), DeValue::Table(t));
        }
        out.push(tree);
        return;
    };
    for (key, inner) in table.iter() {
        above.push((key.clone(), value.span()));
        one_value_trees(inner, above, out);
        above.pop();
    }
}

/// Fills each route's `retry` and `breaker` from `[defaults.*]`, key by key.
fn inherit_defaults(root: &mut DeTable<'_>) {
    let Some(DeValue::Table(defaults)) = root.get("defaults").map(|v| v.get_ref().clone()) else {
        return;
    };
    let Some(routes) = root.get_mut("routes") else {
        return;
    };
    let DeValue::Array(routes) = routes.get_mut() else {
        return;
    };
    for route in routes.iter_mut() {
        let DeValue::Table(route) = route.get_mut() else {
            continue;
        };
        for section in ["retry", "breaker"] {
            let Some((key, inherited)) = defaults.get_key_value(section) else {
                continue;
            };
            match route.get_mut(section) {
                Some(own) => merge(own, inherited),
                None => {
                    route.insert(key.clone(), inherited.clone());
                }
            }
        }
    }
}

/// Adds to `own` every key of `inherited` it lacks, recursing into tables both have.
fn merge<'i>(own: &mut Spanned<DeValue<'i>>, inherited: &Spanned<DeValue<'i>>) {
    let (DeValue::Table(own), DeValue::Table(inherited)) = (own.get_mut(), inherited.get_ref())
    else {
        return;
    };
    for (key, value) in inherited.iter() {
        match own.get_mut(key.get_ref().as_ref()) {
            Some(existing) => merge(existing, value),
            None => {
                own.insert(key.clone(), value.clone());
            }
        }
    }
}

/// The source span of the value at `path`, or of its nearest ancestor present.
fn locate(tree: &Spanned<DeTable<'_>>, path: &KeyPath) -> Option<Range<usize>> {
    let mut span = None;
    let mut node: Option<&DeValue<'_>> = None;
    for seg in &path.0 {
        let next = match (seg, node) {
            (Segment::Key(k), None) => tree.get_ref().get(k.as_str()),
            (Segment::Key(k), Some(DeValue::Table(t))) => t.get(k.as_str()),
            (Segment::Index(i), Some(DeValue::Array(a))) => a.get(*i),
            _ => None,
        };
        match next {
            Some(v) => {
                span = Some(v.span());
                node = Some(v.get_ref());
            }
            None => break,
        }
    }
    span
}

/// Where the file's lines end: the line of each of thousands of errors
/// is a binary search, not a count from the top of the file.
struct Lines(Vec<usize>);

impl Lines {
    fn new(src: &str) -> Self {
        Lines(
            src.bytes()
                .enumerate()
                .filter_map(|(i, b)| (b == b'\n').then_some(i))
                .collect(),
        )
    }

    /// The 1-based line of byte `offset`.
    fn of(&self, offset: usize) -> usize {
        self.0.partition_point(|&newline| newline < offset) + 1
    }
}
