//! The sockets, as vLLM's `ZmqEventPublisher` runs them: a PUB socket sending
//! `[topic, seq (8 bytes big-endian), payload]` per batch (bound when the endpoint has a wildcard,
//! else connected, so a pod can push to a router's SUB), and an optional ROUTER socket for replay:
//! a client sends `["", start seq (8 bytes big-endian)]` and gets back every buffered batch from that
//! sequence number on as `["", seq, payload]`, then `["", -1, ""]`.

use std::collections::VecDeque;

use bytes::Bytes;
use tokio::sync::mpsc;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// The end-of-replay marker's sequence number.
const END_SEQ: i64 = -1;

/// vLLM's rule: bind on a wildcard address (or ipc), connect otherwise.
pub fn binds(endpoint: &str) -> bool {
    endpoint.contains('*') || endpoint.contains("::") || endpoint.starts_with("ipc://")
}

pub struct Publisher {
    publish: PubSocket,
    replay: Option<RouterSocket>,
    topic: Bytes,
    next_seq: u64,
    /// The last `buffer_steps` batches for replay.
    buffer: VecDeque<(u64, Bytes)>,
    buffer_steps: usize,
}

impl Publisher {
    /// Opens the sockets. Errors name the endpoint, never anything else of the host.
    pub async fn open(endpoint: &str, replay_endpoint: Option<&str>, topic: &str, buffer_steps: usize) -> anyhow::Result<Self> {
        let mut publish = PubSocket::new();
        if binds(endpoint) {
            publish.bind(endpoint).await.map_err(|e| anyhow::anyhow!("cannot bind the KV-event socket {endpoint}: {e}"))?;
        } else {
            publish.connect(endpoint).await.map_err(|e| anyhow::anyhow!("cannot connect the KV-event socket to {endpoint}: {e}"))?;
        }
        let replay = match replay_endpoint {
            Some(r) => {
                let mut socket = RouterSocket::new();
                socket.bind(r).await.map_err(|e| anyhow::anyhow!("cannot bind the KV-event replay socket {r}: {e}"))?;
                Some(socket)
            }
            None => None,
        };
        Ok(Publisher {
            publish,
            replay,
            topic: Bytes::copy_from_slice(topic.as_bytes()),
            next_seq: 0,
            buffer: VecDeque::new(),
            buffer_steps: buffer_steps.max(1),
        })
    }

    /// Publishes payloads until the sender side closes, answering replay requests in between.
    pub async fn run(mut self, mut payloads: mpsc::Receiver<Vec<u8>>) {
        loop {
            let replay = async {
                match self.replay.as_mut() {
                    Some(r) => r.recv().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                payload = payloads.recv() => match payload {
                    Some(p) => self.publish(Bytes::from(p)).await,
                    None => break,
                },
                request = replay => match request {
                    Ok(request) => self.serve_replay(request).await,
                    Err(e) => tracing::debug!(error = %e, "KV-event replay receive failed"),
                },
            }
        }
    }

    async fn publish(&mut self, payload: Bytes) {
        let seq = self.next_seq;
        self.next_seq += 1;
        let frames = vec![self.topic.clone(), Bytes::copy_from_slice(&seq.to_be_bytes()), payload.clone()];
        if let Ok(message) = ZmqMessage::try_from(frames) {
            // No subscriber (or a slow one) loses the batch, as with vLLM; replay covers gaps.
            if let Err(e) = self.publish.send(message).await {
                tracing::debug!(error = %e, seq, "KV-event batch not sent");
            }
        }
        self.buffer.push_back((seq, payload));
        while self.buffer.len() > self.buffer_steps {
            self.buffer.pop_front();
        }
    }

    async fn serve_replay(&mut self, request: ZmqMessage) {
        // [identity, "", start seq]: anything else is ignored (logged), as vLLM does.
        let frames = request.into_vec();
        let (Some(identity), Some(start)) = (frames.first(), frames.get(2)) else {
            tracing::debug!(frames = frames.len(), "invalid KV-event replay request");
            return;
        };
        let Ok(start) = <[u8; 8]>::try_from(start.as_ref()).map(u64::from_be_bytes) else {
            tracing::debug!("invalid KV-event replay start sequence");
            return;
        };
        let Some(replay) = self.replay.as_mut() else { return };
        let empty = Bytes::new();
        for (seq, payload) in self.buffer.iter().filter(|(s, _)| *s >= start) {
            let frames = vec![identity.clone(), empty.clone(), Bytes::copy_from_slice(&seq.to_be_bytes()), payload.clone()];
            if let Ok(m) = ZmqMessage::try_from(frames) {
                if replay.send(m).await.is_err() {
                    return;
                }
            }
        }
        let end = vec![identity.clone(), empty.clone(), Bytes::copy_from_slice(&END_SEQ.to_be_bytes()), empty];
        if let Ok(m) = ZmqMessage::try_from(end) {
            let _ = replay.send(m).await;
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn wildcard_endpoints_bind_others_connect() {
        assert!(super::binds("tcp://*:5557"));
        assert!(super::binds("tcp://[::]:5557"));
        assert!(!super::binds("tcp://indexer.llm-d:5557"));
    }
}
