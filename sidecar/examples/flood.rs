//! What hostile local clients can make the sidecar hold (`--example flood`): starts the
//! real `rebound-sidecar` binary on `examples/policies/` and, one attack at a time, prints
//! its RSS before, at the peak while the attack holds its connections open, 20 s later
//! (still open), and after the attacker leaves, and whether a Decide from an ordinary
//! client was answered meanwhile. A program that prints figures, not a test.
//!
//! cargo build --release -p rebound-sidecar --bins --example flood --features testkit \
//!   && target/release/examples/flood

use std::{
    net::SocketAddr,
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use clap::Parser;
use rebound_sidecar::{
    client,
    pb::v1::{self as pb, retry_advisor_client::RetryAdvisorClient},
    testkit::{
        flood::{Outcome, half_sent_calls},
        process::{mib, rss_kib, sidecar_binary, spawn_on_policies_file},
    },
};
use rebound_test_support::free_port;

#[derive(Debug, Parser)]
#[command(name = "flood")]
struct Args {
    /// The sidecar binary; by default the one next to this program.
    #[arg(long)]
    sidecar: Option<PathBuf>,
    /// How long each attack is held open before the attacker leaves.
    #[arg(long, default_value_t = 20)]
    hold_seconds: u64,
}

/// One attack: half-sent calls of `path` on the gRPC or the admin port.
struct Attack {
    name: &'static str,
    admin: bool,
    path: &'static str,
    connections: usize,
    streams: usize,
    announced: u32,
    sent: usize,
}

const ATTACKS: &[Attack] = &[
    Attack {
        name: "2 conns x 128 DecideBatch, 512 KiB announced, 500 KB sent",
        admin: false,
        path: "/rebound.v1.RetryAdvisor/DecideBatch",
        connections: 2,
        streams: 128,
        announced: 524_000,
        sent: 500_000,
    },
    Attack {
        name: "63 conns (the cap less the worker's) x 32 DecideBatch, 500 KB sent",
        admin: false,
        path: "/rebound.v1.RetryAdvisor/DecideBatch",
        connections: 63,
        streams: 32,
        announced: 524_000,
        sent: 500_000,
    },
    Attack {
        name: "admin: 100 conns x 16 health Check, 16 KB sent",
        admin: true,
        path: "/grpc.health.v1.Health/Check",
        connections: 100,
        streams: 16,
        announced: 16_000,
        sent: 16_000,
    },
];

fn main() -> Result<()> {
    let args = Args::parse();
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(run(args))
}

async fn run(args: Args) -> Result<()> {
    let sidecar_bin = sidecar_binary(args.sidecar.clone())?;
    let policies =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/policies/webhooks.yaml");
    println!(
        "| attack | refused | other ends | RSS before | peak | after {} s open | after leaving | Decide meanwhile |",
        args.hold_seconds
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---|");
    for attack in ATTACKS {
        // A fresh sidecar per attack, so one's leftovers do not count for the next.
        let (grpc, admin) = (free_port()?, free_port()?);
        let dir = std::env::temp_dir().join(format!("rebound-flood-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let sidecar = spawn_on_policies_file(&sidecar_bin, &policies, grpc, admin, dir)?;
        let pid = sidecar.pid();
        let started = Instant::now();
        while decide(grpc).await.is_err() {
            if started.elapsed() > Duration::from_secs(30) {
                bail!("the sidecar did not answer within 30 s");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let before = rss_kib(pid);

        let peak = Arc::new(AtomicU64::new(before));
        let sampling = Arc::new(AtomicBool::new(true));
        let sampler = {
            let (peak, sampling) = (Arc::clone(&peak), Arc::clone(&sampling));
            std::thread::spawn(move || {
                while sampling.load(Ordering::Relaxed) {
                    peak.fetch_max(rss_kib(pid), Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis(5));
                }
            })
        };
        // The probe is a worker's client: connected before the attack, as workers are.
        let mut worker = RetryAdvisorClient::new(client::tcp_channel(grpc).await?);
        let target = if attack.admin { admin } else { grpc };
        let mut flood = half_sent_calls(
            target,
            attack.path,
            attack.connections,
            attack.streams,
            attack.announced,
            attack.sent,
        )
        .await
        .context("open the attack's connections")?;
        let (mut refused, mut other) = (0, 0);
        let mut answered = true;
        let hold = tokio::time::sleep(Duration::from_secs(args.hold_seconds));
        tokio::pin!(hold);
        let mut probe = tokio::time::interval(Duration::from_millis(500));
        loop {
            tokio::select! {
                () = &mut hold => break,
                outcome = flood.next_outcome() => match outcome {
                    Some(Outcome::Status(8)) => refused += 1,
                    Some(_) => other += 1,
                    None => break,
                },
                _ = probe.tick() => {
                    let call = worker.decide(decide_request());
                    answered &= tokio::time::timeout(Duration::from_secs(2), call)
                        .await
                        .is_ok_and(|r| r.is_ok());
                }
            }
        }
        let held = rss_kib(pid);
        drop(flood);
        tokio::time::sleep(Duration::from_secs(2)).await;
        let after = rss_kib(pid);
        sampling.store(false, Ordering::Relaxed);
        let _ = sampler.join();
        println!(
            "| {} | {refused} | {other} | {} | {} | {} | {} | {} |",
            attack.name,
            mib(before),
            mib(peak.load(Ordering::Relaxed)),
            mib(held),
            mib(after),
            if answered {
                "every probe answered"
            } else {
                "a probe failed"
            }
        );
        drop(sidecar);
    }
    Ok(())
}

fn decide_request() -> pb::DecideRequest {
    pb::DecideRequest {
        queue: "webhooks".into(),
        attempt: 1,
        ..Default::default()
    }
}

async fn decide(addr: SocketAddr) -> Result<pb::DecideResponse> {
    let channel = client::tcp_channel(addr).await?;
    let answer = RetryAdvisorClient::new(channel)
        .decide(decide_request())
        .await?;
    Ok(answer.into_inner())
}
