//! Half-sent calls from a raw HTTP/2 client: each announces a gRPC message, sends part of
//! it and never finishes, which is what a buggy or hostile local client does to make a
//! server hold buffers (a gRPC library never sends this).

use std::{future::poll_fn, net::SocketAddr};

use bytes::Bytes;
use tokio::{sync::mpsc, task::JoinSet};

/// What became of one half-sent call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The server answered with this `grpc-status` (8 = RESOURCE_EXHAUSTED).
    Status(i32),
    /// The server reset the stream or closed the connection.
    Reset,
}

/// Half-sent calls held open until this is dropped.
pub struct Flood {
    outcomes: mpsc::UnboundedReceiver<Outcome>,
    _calls: JoinSet<()>,
}

impl Flood {
    /// The next call the server ended, in the order they ended; `None` once every call has.
    pub async fn next_outcome(&mut self) -> Option<Outcome> {
        self.outcomes.recv().await
    }
}

/// Opens `connections` HTTP/2 connections to `addr` and on each `streams` calls of `path`
/// (e.g. `/rebound.v1.RetryAdvisor/DecideBatch`), each announcing a message of `announced`
/// bytes and sending `sent` bytes of it (prefix included) as the server's windows allow.
pub async fn half_sent_calls(
    addr: SocketAddr,
    path: &str,
    connections: usize,
    streams: usize,
    announced: u32,
    sent: usize,
) -> std::io::Result<Flood> {
    let (report, outcomes) = mpsc::unbounded_channel();
    let mut calls = JoinSet::new();
    let mut prefix = vec![0u8];
    prefix.extend(announced.to_be_bytes());
    prefix.resize(sent.max(prefix.len()), b'x');
    let message = Bytes::from(prefix);
    for _ in 0..connections {
        let tcp = tokio::net::TcpStream::connect(addr).await?;
        let (client, connection) = h2::client::handshake(tcp)
            .await
            .map_err(std::io::Error::other)?;
        calls.spawn(async move {
            let _ = connection.await;
        });
        for _ in 0..streams {
            let report = report.clone();
            let client = client.clone();
            let message = message.clone();
            let uri = format!("http://{addr}{path}");
            calls.spawn(async move {
                let outcome = match half_sent_call(client, &uri, message).await {
                    Ok(status) => status,
                    Err(_) => Outcome::Reset,
                };
                let _ = report.send(outcome);
                // Keep the task (and so the connection's other calls) alive until dropped.
                std::future::pending::<()>().await;
            });
        }
    }
    Ok(Flood {
        outcomes,
        _calls: calls,
    })
}

async fn half_sent_call(
    client: h2::client::SendRequest<Bytes>,
    uri: &str,
    mut message: Bytes,
) -> Result<Outcome, h2::Error> {
    let mut client = client.ready().await?;
    let request = http::Request::post(uri)
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .map_err(|_| h2::Error::from(h2::Reason::INTERNAL_ERROR))?;
    let (response, mut body) = client.send_request(request, false)?;
    let sending = async move {
        while !message.is_empty() {
            body.reserve_capacity(message.len());
            match poll_fn(|cx| body.poll_capacity(cx)).await {
                Some(Ok(0)) => continue,
                Some(Ok(granted)) => {
                    let chunk = message.split_to(granted.min(message.len()));
                    body.send_data(chunk, false)?;
                }
                Some(Err(error)) => return Err(error),
                None => break,
            }
        }
        // Sent what it meant to; hold the stream open without finishing it.
        std::future::pending::<()>().await;
        Ok::<_, h2::Error>(())
    };
    let answered = async move {
        let response = response.await?;
        if let Some(status) = grpc_status(response.headers()) {
            return Ok(Outcome::Status(status));
        }
        let mut body = response.into_body();
        while let Some(data) = body.data().await {
            let data = data?;
            let _ = body.flow_control().release_capacity(data.len());
        }
        Ok(
            match body.trailers().await?.as_ref().and_then(grpc_status) {
                Some(status) => Outcome::Status(status),
                None => Outcome::Reset,
            },
        )
    };
    tokio::select! {
        sent = sending => sent.map(|()| Outcome::Reset),
        outcome = answered => outcome,
    }
}

fn grpc_status(headers: &http::HeaderMap) -> Option<i32> {
    headers.get("grpc-status")?.to_str().ok()?.parse().ok()
}
