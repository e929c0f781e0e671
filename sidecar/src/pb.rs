//! Generated protobuf types and gRPC stubs for `rebound.v1`, and the descriptor set that
//! server reflection serves.

use std::marker::PhantomData;

use prost::Message;
use tonic::{
    Status,
    codec::{BufferSettings, Codec, DecodeBuf, Decoder},
};
use tonic_prost::{ProstDecoder, ProstEncoder};

#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod v1 {
    tonic::include_proto!("rebound.v1");
}

/// The server side of `rebound.v1.RetryAdvisor`, generated from the same proto over request
/// messages whose `string` fields are decoded as bytes (identical on the wire), so that
/// invalid UTF-8 is reported per field and per batch item instead of failing the call.
/// Answers are the [`v1`] types.
#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod server {
    include!(concat!(env!("OUT_DIR"), "/server/rebound.v1.rs"));
}

/// The encoded `FileDescriptorSet` of `proto/rebound/v1`, for server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/rebound_v1_descriptor.bin"));

/// Protobuf encoding with 1 KiB starting buffers instead of tonic's 8 KiB: every message of
/// this API is small, so many calls in flight need little buffer memory.
#[derive(Debug)]
pub struct SmallCodec<T, U>(PhantomData<(T, U)>);

const SMALL_BUFFERS: usize = 1024;
/// tonic's default: how much encoded output is buffered before yielding to the runtime.
const YIELD_THRESHOLD: usize = 32 * 1024;

impl<T, U> Default for SmallCodec<T, U> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<T, U> Codec for SmallCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = ProstDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::new(BufferSettings::new(SMALL_BUFFERS, YIELD_THRESHOLD))
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstDecoder::new(BufferSettings::new(SMALL_BUFFERS, YIELD_THRESHOLD))
    }
}

/// A bound on a request message checked on its encoded bytes, before it is decoded, so
/// that e.g. a batch of half a million empty items is refused without building them.
pub trait EncodedBound {
    fn check_encoded(bytes: &[u8]) -> Result<(), Status>;
}

/// The server's codec: [`SmallCodec`] buffers, and [`EncodedBound`] checked before decoding.
#[derive(Debug)]
pub struct ServerCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for ServerCodec<T, U> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<T, U> Codec for ServerCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + EncodedBound + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = BoundedDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::new(BufferSettings::new(SMALL_BUFFERS, YIELD_THRESHOLD))
    }

    fn decoder(&mut self) -> Self::Decoder {
        BoundedDecoder(ProstDecoder::new(BufferSettings::new(
            SMALL_BUFFERS,
            YIELD_THRESHOLD,
        )))
    }
}

/// Checks [`EncodedBound`], then decodes with prost.
#[derive(Debug)]
pub struct BoundedDecoder<U>(ProstDecoder<U>);

impl<U: Message + Default + EncodedBound> Decoder for BoundedDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        // The buffer holds exactly one whole message, contiguous.
        U::check_encoded(prost::bytes::Buf::chunk(src))?;
        self.0.decode(src)
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.0.buffer_settings()
    }
}

/// Counts the length-delimited occurrences of top-level field `field` in an encoded
/// message, stopping past `stop_after`; malformed input is left to the decoder to report.
pub fn count_field(mut bytes: &[u8], field: u64, stop_after: usize) -> usize {
    fn varint(bytes: &mut &[u8]) -> Option<u64> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let (&b, rest) = bytes.split_first()?;
            *bytes = rest;
            value |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Some(value);
            }
        }
        None
    }
    let mut count = 0;
    while !bytes.is_empty() && count <= stop_after {
        let Some(key) = varint(&mut bytes) else { break };
        let skip = match key & 7 {
            0 => {
                if varint(&mut bytes).is_none() {
                    break;
                }
                0
            }
            1 => 8,
            2 => {
                let Some(len) = varint(&mut bytes) else { break };
                if key >> 3 == field {
                    count += 1;
                }
                usize::try_from(len).unwrap_or(usize::MAX)
            }
            5 => 4,
            _ => break,
        };
        if skip > bytes.len() {
            break;
        }
        bytes = &bytes[skip..];
    }
    count
}

/// The fully qualified service name, as health checks and reflection know it.
pub const ADVISOR_SERVICE: &str = "rebound.v1.RetryAdvisor";

#[cfg(test)]
mod tests {
    use prost::{Message, bytes::Bytes};

    use super::{server as wire, v1 as pb};

    /// The server's request text is sliced out of the received bytes, not copied per field.
    #[test]
    fn request_text_borrows_the_received_message() {
        let sent = pb::DecideRequest {
            queue: "orders".to_owned(),
            attempt: 2,
            job_id: "job-7".to_owned(),
            error_class: "Timeout".to_owned(),
            ..Default::default()
        };
        let received = Bytes::from(sent.encode_to_vec());
        let req = wire::DecideRequest::decode(received.clone()).expect("decodes");
        let within = received.as_ptr_range();
        for (field, text, want) in [
            ("queue", &req.queue, "orders"),
            ("job_id", &req.job_id, "job-7"),
            ("error_class", &req.error_class, "Timeout"),
        ] {
            assert_eq!(&text[..], want.as_bytes(), "{field}");
            assert!(within.contains(&text.as_ptr()), "{field} was copied");
        }
    }
}
