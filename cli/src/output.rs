//! Output formats and writing to stdout without panicking on a closed pipe.

use std::io::{ErrorKind, Write};

use anyhow::Result;
use clap::ValueEnum;
use serde_json::Value;

/// `-o`: text for people, JSON or YAML (the same document) for scripts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Format {
    #[value(alias = "table")]
    Text,
    Json,
    Yaml,
}

pub fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.downcast_ref::<std::io::Error>()
        .is_some_and(|io| io.kind() == ErrorKind::BrokenPipe)
}

/// Writes to stdout, returning write errors instead of panicking like `print!`.
pub fn emit(text: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())?;
    out.flush()?;
    Ok(())
}

/// Emits `value` as JSON or YAML, or `text` for the text format.
pub fn emit_as(format: Format, value: &Value, text: impl FnOnce() -> String) -> Result<()> {
    match format {
        Format::Text => emit(&text()),
        Format::Json => emit(&format!("{}\n", serde_json::to_string_pretty(value)?)),
        Format::Yaml => emit(&serde_saphyr::to_string(value)?),
    }
}

/// `snake_case` keys to the API's `camelCase`, for structs of the policy crate that
/// serialise with Rust names.
pub fn camel_keys(value: Value) -> Value {
    match value {
        Value::Object(map) => Value::Object(
            map.into_iter()
                .map(|(k, v)| (camel(&k), camel_keys(v)))
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.into_iter().map(camel_keys).collect()),
        other => other,
    }
}

fn camel(key: &str) -> String {
    let mut out = String::with_capacity(key.len());
    let mut upper = false;
    for c in key.chars() {
        if c == '_' {
            upper = true;
        } else if upper {
            out.extend(c.to_uppercase());
            upper = false;
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snake_keys_become_camel_and_values_stay() {
        let v = serde_json::json!({"give_up_after_ms": {"p50": 1}, "retries": [{"min_ms": 2, "x": "a_b"}]});
        assert_eq!(
            camel_keys(v),
            serde_json::json!({"giveUpAfterMs": {"p50": 1}, "retries": [{"minMs": 2, "x": "a_b"}]})
        );
    }
}
