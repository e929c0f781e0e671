//! The sidecar's reader: a compiled document read once, straight into a [`PolicyTable`].
//!
//! Names, namespaces and queue patterns are borrowed from the input (copied only when a
//! JSON escape forces it), checked, and packed into the table's blocks; per policy nothing
//! is allocated but what the table keeps. Freeing the table a reload replaces then returns
//! whole pages instead of leaving them pinned by strings of the new one.
//!
//! The document is the one [`CompiledDocument`](super::CompiledDocument) describes and
//! is accepted or rejected exactly as [`CompiledDocument::from_json`] does, with the same
//! errors: the same serde visitors' messages, parse errors before any policy's check
//! failure, and the first failing policy in document order.
//!
//! [`CompiledDocument::from_json`]: super::CompiledDocument::from_json

use std::{borrow::Cow, fmt};

use serde::de::{
    self, DeserializeSeed, Deserializer, Error as _, IgnoredAny, MapAccess, SeqAccess, Visitor,
};

use super::{
    CompiledRollout, DocumentError, PolicyTable, RawDocument, check_policy,
    rollout::RolloutEntry,
    table::{Indexes, Packer, TableEntry},
};
use crate::resolve::ResolvedPolicy;

impl PolicyTable {
    /// Parses, fully checks and indexes a document from outside the process in one pass
    /// over `policies`; any failure rejects the whole document with the [`DocumentError`]
    /// that [`CompiledDocument::from_json`](super::CompiledDocument::from_json) gives.
    pub fn from_json(bytes: &[u8]) -> Result<Self, DocumentError> {
        let raw = RawDocument::read(bytes)?;
        let mut builder = Builder::default();
        // As `serde_json::from_str` does: the same positions in errors as the other reader.
        let mut de = serde_json::Deserializer::from_str(raw.policies.get());
        Policies(&mut builder).deserialize(&mut de)?;
        de.end()?;
        if let Some(error) = builder.failed {
            return Err(error);
        }
        let indexes = Indexes::build(builder.queues.iter().map(|(q, i)| (q.as_ref(), *i)));
        Ok(Self::assemble(
            raw.namespace,
            raw.hash,
            builder.entries,
            builder.packer,
            indexes,
        ))
    }
}

/// What the table is built from, filled policy by policy.
#[derive(Default)]
struct Builder<'de> {
    /// Every queue pattern with its policy's position, in document order.
    queues: Vec<(Cow<'de, str>, usize)>,
    entries: Vec<TableEntry>,
    packer: Packer,
    /// Policies read so far: the position of the next one.
    read: usize,
    /// The first policy that failed its checks; reading goes on so that a parse error
    /// further on still wins, as it does for the other reader.
    failed: Option<DocumentError>,
}

impl<'de> Builder<'de> {
    fn add(&mut self, policy: Policy<'de>, queues_from: usize) {
        self.read += 1;
        if self.failed.is_some() {
            return;
        }
        let Policy {
            name,
            namespace,
            generation,
            params,
            rollout,
        } = policy;
        let queues = self.queues[queues_from..].iter().map(|(q, _)| q.as_ref());
        match check_policy(&namespace, &name, &params, queues, rollout.as_ref()) {
            Err(error) => self.failed = Some(error),
            Ok(exposure) => {
                let entry = self
                    .packer
                    .entry(&namespace, &name, generation, params, |identity| {
                        rollout
                            .zip(exposure)
                            .map(|(r, e)| RolloutEntry::checked(identity, r, e))
                    });
                self.entries.push(entry);
            }
        }
    }
}

/// One policy's fields other than its queues (those go straight to the builder).
struct Policy<'de> {
    name: Cow<'de, str>,
    namespace: Cow<'de, str>,
    generation: i64,
    params: ResolvedPolicy,
    rollout: Option<CompiledRollout>,
}

/// A JSON string, borrowed unless it holds an escape; fails like `String` does.
struct Text<'de>(Cow<'de, str>);

impl<'de> de::Deserialize<'de> for Text<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct TextVisitor;
        impl<'de> Visitor<'de> for TextVisitor {
            type Value = Text<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Owned(v)))
            }
        }
        deserializer.deserialize_string(TextVisitor)
    }
}

/// The `policies` array, each element added to the builder as it is read.
struct Policies<'b, 'de>(&'b mut Builder<'de>);

impl<'de> DeserializeSeed<'de> for Policies<'_, 'de> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for Policies<'_, 'de> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a sequence")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(PolicySeed(&mut *self.0))?.is_some() {}
        Ok(())
    }
}

/// One policy's queue patterns, pushed to the builder under its position.
struct Queues<'b, 'de> {
    into: &'b mut Vec<(Cow<'de, str>, usize)>,
    policy: usize,
}

impl<'de> DeserializeSeed<'de> for Queues<'_, 'de> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for Queues<'_, 'de> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a sequence")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while let Some(Text(q)) = seq.next_element()? {
            self.into.push((q, self.policy));
        }
        Ok(())
    }
}

/// A `CompiledPolicy`, read field by field as its derived `Deserialize` reads it (a map,
/// or a sequence in field order), with the same messages for missing, repeated and
/// mistyped fields.
struct PolicySeed<'b, 'de>(&'b mut Builder<'de>);

const FIELDS: &[&str] = &[
    "name",
    "namespace",
    "uid",
    "generation",
    "queues",
    "params",
    "rollout",
];

enum Field {
    Name,
    Namespace,
    Uid,
    Generation,
    Queues,
    Params,
    Rollout,
    Other,
}

impl<'de> de::Deserialize<'de> for Field {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct FieldVisitor;
        impl Visitor<'_> for FieldVisitor {
            type Value = Field;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("field identifier")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Field, E> {
                Ok(match v {
                    "name" => Field::Name,
                    "namespace" => Field::Namespace,
                    "uid" => Field::Uid,
                    "generation" => Field::Generation,
                    "queues" => Field::Queues,
                    "params" => Field::Params,
                    "rollout" => Field::Rollout,
                    _ => Field::Other,
                })
            }
        }
        deserializer.deserialize_identifier(FieldVisitor)
    }
}

impl<'de> DeserializeSeed<'de> for PolicySeed<'_, 'de> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_struct("CompiledPolicy", FIELDS, self)
    }
}

impl<'de> Visitor<'de> for PolicySeed<'_, 'de> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("struct CompiledPolicy")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let builder = self.0;
        let (mut name, mut namespace, mut uid, mut generation) = (None, None, None, None);
        let (mut queues_from, mut params, mut rollout) = (None, None, None);
        fn once<T, E: de::Error>(slot: &Option<T>, field: &'static str) -> Result<(), E> {
            match slot {
                Some(_) => Err(E::duplicate_field(field)),
                None => Ok(()),
            }
        }
        while let Some(key) = map.next_key::<Field>()? {
            match key {
                Field::Name => {
                    once(&name, "name")?;
                    name = Some(map.next_value::<Text>()?.0);
                }
                Field::Namespace => {
                    once(&namespace, "namespace")?;
                    namespace = Some(map.next_value::<Text>()?.0);
                }
                Field::Uid => {
                    once(&uid, "uid")?;
                    uid = Some(map.next_value::<Text>()?.0);
                }
                Field::Generation => {
                    once(&generation, "generation")?;
                    generation = Some(map.next_value::<i64>()?);
                }
                Field::Queues => {
                    once(&queues_from, "queues")?;
                    queues_from = Some(builder.queues.len());
                    map.next_value_seed(Queues {
                        into: &mut builder.queues,
                        policy: builder.read,
                    })?;
                }
                Field::Params => {
                    once(&params, "params")?;
                    params = Some(map.next_value::<ResolvedPolicy>()?);
                }
                Field::Rollout => {
                    once(&rollout, "rollout")?;
                    rollout = Some(map.next_value::<Option<CompiledRollout>>()?);
                }
                Field::Other => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        let policy = Policy {
            name: name.ok_or_else(|| A::Error::missing_field("name"))?,
            namespace: namespace.ok_or_else(|| A::Error::missing_field("namespace"))?,
            generation: generation.unwrap_or(0),
            params: {
                queues_from.ok_or_else(|| A::Error::missing_field("queues"))?;
                params.ok_or_else(|| A::Error::missing_field("params"))?
            },
            rollout: rollout.flatten(),
        };
        builder.add(policy, queues_from.unwrap_or(builder.queues.len()));
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let builder = self.0;
        let short = |i| A::Error::invalid_length(i, &"struct CompiledPolicy with 7 elements");
        let name = seq.next_element::<Text>()?.ok_or_else(|| short(0))?.0;
        let namespace = seq.next_element::<Text>()?.ok_or_else(|| short(1))?.0;
        seq.next_element::<Text>()?;
        let generation = seq.next_element::<i64>()?.unwrap_or(0);
        let queues_from = builder.queues.len();
        seq.next_element_seed(Queues {
            into: &mut builder.queues,
            policy: builder.read,
        })?
        .ok_or_else(|| short(4))?;
        let params = seq
            .next_element::<ResolvedPolicy>()?
            .ok_or_else(|| short(5))?;
        let rollout = seq.next_element::<Option<CompiledRollout>>()?.flatten();
        let policy = Policy {
            name,
            namespace,
            generation,
            params,
            rollout,
        };
        builder.add(policy, queues_from);
        Ok(())
    }
}
