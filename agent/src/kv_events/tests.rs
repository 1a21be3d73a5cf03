//! The event stream as a router receives it: a ZeroMQ SUB socket (bound, like llm-d's indexer; the
//! agent connects) gets the batches of a real block manager's changes; they are decoded by walking
//! generic msgpack values (rmpv) against vLLM's layout, and every hash is checked against an
//! independent implementation of the scheme (Python: hashlib + cbor2).

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use peregrine_engine::kv::{BlockManager, KvEventBatch};
use rmpv::Value;
use serde_json::json;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use super::{start, KvEventsArgs};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Block hashes per chain from `agent/tests/python/vllm_block_hashes.py`.
fn reference_hashes(seed: &str, block_size: usize, chains: &[(Vec<u32>, Option<u64>)]) -> (u64, Vec<Vec<u64>>) {
    let python = std::env::var("PEREGRINE_PYTHON")
        .unwrap_or_else(|_| panic!("PEREGRINE_PYTHON is not set: run `make python-deps` (installs cbor2) and export the python it prints"));
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/vllm_block_hashes.py");
    let input = json!({
        "seed": seed,
        "block_size": block_size,
        "chains": chains.iter().map(|(t, e)| json!({"tokens": t, "extra": e.map(|id| vec![id])})).collect::<Vec<_>>(),
    });
    let mut child = Command::new(python).arg(script).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    child.stdin.take().unwrap().write_all(input.to_string().as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let chains = v["chains"].as_array().unwrap().iter().map(|c| c.as_array().unwrap().iter().map(|h| h.as_u64().unwrap()).collect()).collect();
    (v["none_hash"].as_u64().unwrap(), chains)
}

#[test]
fn hashes_match_an_independent_implementation() {
    let long: Vec<u32> = (0..40).map(|i| i * 7919 % 50_000).collect();
    let chains = vec![(vec![1, 2, 3, 4, 5, 6, 7, 8], None), (long.clone(), None), (long, Some(3)), (vec![70_000, 1 << 31, 23, 24], None)];
    for seed in ["", "0", "12345"] {
        let (root, want) = reference_hashes(seed, 4, &chains);
        assert_eq!(super::hash::none_hash(seed), root, "seed {seed:?}");
        for ((tokens, extra), want) in chains.iter().zip(want) {
            let mut prev = root;
            let got: Vec<u64> = tokens
                .chunks_exact(4)
                .map(|c| {
                    prev = super::hash::block_hash(prev, c, *extra);
                    prev
                })
                .collect();
            assert_eq!(got, want, "seed {seed:?}, tokens {tokens:?}");
        }
    }
}

fn uint(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not an unsigned integer: {v}"))
}

fn uints(v: &Value) -> Vec<u64> {
    v.as_array().unwrap_or_else(|| panic!("not an array: {v}")).iter().map(uint).collect()
}

/// One decoded event, checked against vLLM's field order and types on the way.
#[derive(Debug, PartialEq)]
enum Decoded {
    Stored { hashes: Vec<u64>, parent: Option<u64>, tokens: Vec<u64>, block_size: u64, lora_id: Option<u64> },
    Removed { hashes: Vec<u64> },
    Cleared,
}

fn decode_batch(payload: &[u8]) -> (f64, Vec<Decoded>) {
    let mut rd = payload;
    let v = rmpv::decode::read_value(&mut rd).unwrap();
    assert!(rd.is_empty(), "one value per payload");
    let fields = v.as_array().expect("KVEventBatch is an array");
    assert_eq!(fields.len(), 3, "[ts, events, data_parallel_rank]");
    assert!(matches!(fields[0], Value::F64(_)), "ts is a float64: {}", fields[0]);
    assert_eq!(uint(&fields[2]), 0, "data_parallel_rank");
    let events = fields[1]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let e = e.as_array().expect("an event is an array");
            match e[0].as_str().expect("the tag comes first") {
                "BlockStored" => {
                    assert_eq!(e.len(), 7, "{e:?}");
                    assert_eq!(e[6].as_str(), Some("GPU"), "medium");
                    Decoded::Stored {
                        hashes: uints(&e[1]),
                        parent: (!e[2].is_nil()).then(|| uint(&e[2])),
                        tokens: uints(&e[3]),
                        block_size: uint(&e[4]),
                        lora_id: (!e[5].is_nil()).then(|| uint(&e[5])),
                    }
                }
                "BlockRemoved" => {
                    assert_eq!(e.len(), 3, "{e:?}");
                    assert_eq!(e[2].as_str(), Some("GPU"), "medium");
                    Decoded::Removed { hashes: uints(&e[1]) }
                }
                "AllBlocksCleared" => {
                    assert_eq!(e.len(), 1);
                    Decoded::Cleared
                }
                other => panic!("unknown tag {other}"),
            }
        })
        .collect();
    (fields[0].as_f64().unwrap(), events)
}

async fn recv(sub: &mut SubSocket) -> Vec<Bytes> {
    tokio::time::timeout(Duration::from_secs(10), sub.recv()).await.expect("a batch within 10 s").unwrap().into_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscriber_receives_vllm_batches_and_replays_missed_ones() {
    // Our SUB binds an OS-chosen port (a port picked beforehand can be taken by another test's
    // connection in between: CI saw AddrInUse here once).
    let mut sub = SubSocket::new();
    let pub_port = match sub.bind("tcp://127.0.0.1:0").await.unwrap() {
        zeromq::Endpoint::Tcp(_, port) => port,
        other => panic!("a TCP endpoint, not {other}"),
    };
    sub.subscribe("kv@").await.unwrap();

    // The agent binds its replay socket itself; a port picked beforehand can be lost the same way,
    // so a bind failure tries another one.
    let mut started = None;
    for _ in 0..5 {
        let replay_port = free_port();
        let args = KvEventsArgs {
            kv_events_endpoint: Some(format!("tcp://127.0.0.1:{pub_port}")),
            kv_events_replay_endpoint: Some(format!("tcp://127.0.0.1:{replay_port}")),
            kv_events_topic: Some("kv@10.0.0.7@smol".into()),
            kv_events_buffer_steps: 100,
            kv_events_hash_seed: "42".into(),
        };
        let (tx, rx) = crossbeam_channel::bounded(16);
        match start(&args, "smol", rx).await {
            Ok(()) => {
                started = Some((tx, replay_port));
                break;
            }
            Err(e) => eprintln!("replay port {replay_port}: {e}; trying another"),
        }
    }
    let (tx, replay_port) = started.expect("the publisher starts on one of five free ports");
    // The agent connects to us: give the connection (and subscription) time to settle, as a
    // router would, by sending a probe until one arrives.
    let mut blocks = BlockManager::new(4, 4, true);
    blocks.enable_events();
    let probe = || KvEventBatch { ts: 1.0, block_size: 4, events: vec![peregrine_engine::kv::KvEvent::AllCleared] };
    let mut first = None;
    for _ in 0..50 {
        tx.send(probe()).unwrap();
        if let Ok(Ok(m)) = tokio::time::timeout(Duration::from_millis(200), sub.recv()).await {
            first = Some(m.into_vec());
            break;
        }
    }
    let first = first.expect("the subscriber is reached");
    assert_eq!(first[0].as_ref(), b"kv@10.0.0.7@smol");
    let first_seq = u64::from_be_bytes(first[1].as_ref().try_into().unwrap());
    assert_eq!(decode_batch(&first[2]).1, vec![Decoded::Cleared]);
    // Drain probes that were sent while connecting.
    while let Ok(Ok(_)) = tokio::time::timeout(Duration::from_millis(300), sub.recv()).await {}

    // Real block-manager changes: a 9-token prompt on adapter 5 (two full blocks), then a 14-token
    // base prompt that needs all four blocks and evicts both of the first.
    let a: Vec<u32> = (100..109).collect();
    let b: Vec<u32> = (200..214).collect();
    blocks.take_events(); // the AllCleared of enable_events, already shown above
    blocks.allocate(1, &a, Some(5)).unwrap();
    blocks.commit_computed(1, &a, 9);
    blocks.free(1);
    tx.send(KvEventBatch { ts: 2.5, block_size: 4, events: blocks.take_events() }).unwrap();
    blocks.allocate(2, &b, None).unwrap();
    blocks.commit_computed(2, &b, 14);
    tx.send(KvEventBatch { ts: 3.5, block_size: 4, events: blocks.take_events() }).unwrap();

    let (_, reference) = reference_hashes("42", 4, &[(a.clone(), Some(5)), (b.clone(), None)]);
    let (ha, hb) = (&reference[0], &reference[1]);
    let m1 = recv(&mut sub).await;
    let m2 = recv(&mut sub).await;
    let seq1 = u64::from_be_bytes(m1[1].as_ref().try_into().unwrap());
    let seq2 = u64::from_be_bytes(m2[1].as_ref().try_into().unwrap());
    assert_eq!(seq2, seq1 + 1, "sequence numbers count batches");
    assert!(seq1 > first_seq);
    let (ts1, ev1) = decode_batch(&m1[2]);
    assert_eq!(ts1, 2.5);
    assert_eq!(
        ev1,
        vec![Decoded::Stored {
            hashes: ha.clone(),
            parent: None,
            tokens: a[..8].iter().map(|&t| u64::from(t)).collect(),
            block_size: 4,
            lora_id: Some(5),
        }]
    );
    let (_, ev2) = decode_batch(&m2[2]);
    // a's chain is evicted tail first, then b's three full blocks are stored.
    assert_eq!(
        ev2,
        vec![
            Decoded::Removed { hashes: vec![ha[1], ha[0]] },
            Decoded::Stored { hashes: hb.clone(), parent: None, tokens: b[..12].iter().map(|&t| u64::from(t)).collect(), block_size: 4, lora_id: None },
        ]
    );

    // Replay from seq1: both batches again, byte for byte, then the end marker.
    let mut dealer = DealerSocket::new();
    dealer.connect(&format!("tcp://127.0.0.1:{replay_port}")).await.unwrap();
    let request: Vec<Bytes> = vec![Bytes::new(), Bytes::copy_from_slice(&seq1.to_be_bytes())];
    dealer.send(ZmqMessage::try_from(request).unwrap()).await.unwrap();
    let mut replayed = Vec::new();
    loop {
        let m = tokio::time::timeout(Duration::from_secs(10), dealer.recv()).await.unwrap().unwrap().into_vec();
        assert_eq!(m.len(), 3, "[\"\", seq, payload]");
        assert!(m[0].is_empty());
        let seq = i64::from_be_bytes(m[1].as_ref().try_into().unwrap());
        if seq == -1 {
            assert!(m[2].is_empty());
            break;
        }
        replayed.push((seq as u64, m[2].clone()));
    }
    assert_eq!(replayed, vec![(seq1, m1[2].clone()), (seq2, m2[2].clone())]);
}
