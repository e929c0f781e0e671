//! Generated protobuf types and gRPC stubs for `rebound.v1`, and the descriptor set that
//! server reflection serves.

use std::marker::PhantomData;

use prost::Message;
use tonic::codec::{BufferSettings, Codec};
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

/// The fully qualified service name, as health checks and reflection know it.
pub const ADVISOR_SERVICE: &str = "rebound.v1.RetryAdvisor";
