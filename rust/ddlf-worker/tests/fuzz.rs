//! Property-based fuzzing of everything a daemon decodes before any user code runs: protobuf messages, the
//! chunk framing of streamed requests (declared lengths, data, headers in the wrong place) and shared-memory
//! references. A bounded number of cases runs with `cargo test` (and so in CI); raise `PROPTEST_CASES` for a
//! longer hunt. Any input that ever crashed the daemon belongs here as a fixed regression case.

use std::sync::OnceLock;
use std::time::Duration;

use ddlf_net::{ClientConfig, ServerConfig, WorkerConn};
use ddlf_proto::{CallReply, CallRequest, Chunk, ShmRef, Value};
use ddlf_worker::{Daemon, DaemonConfig, Next};
use proptest::prelude::*;

struct Fixture {
    rt: tokio::runtime::Runtime,
    address: String,
    conn: WorkerConn,
    _daemon: std::sync::Mutex<Daemon>,
}

/// One daemon (with a Rust echo interpreter) shared by every case.
fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let (daemon, rx) = Daemon::start(DaemonConfig {
            listen: "127.0.0.1:0".into(),
            server: ServerConfig {
                max_message_size: 1 << 16,
                ..Default::default()
            },
            ..Default::default()
        })
        .unwrap();
        std::thread::spawn(move || loop {
            match rx.next(Duration::from_millis(20)) {
                Next::Job(job) => {
                    let value = job.request.value.clone();
                    job.respond(CallReply {
                        value,
                        ..Default::default()
                    });
                }
                Next::Idle => {}
                Next::Shutdown => return,
            }
        });
        let rt = tokio::runtime::Runtime::new().unwrap();
        let address = daemon.local_addr().to_string();
        let conn = rt
            .block_on(WorkerConn::connect(&address, &ClientConfig::default()))
            .unwrap();
        Fixture {
            rt,
            address,
            conn,
            _daemon: std::sync::Mutex::new(daemon),
        }
    })
}

fn arb_value() -> impl Strategy<Value = Option<Value>> {
    proptest::option::of(
        (
            proptest::collection::vec(any::<u8>(), 0..32),
            proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..16), 0..3),
            proptest::option::of((
                "[a-z./-]{0,24}",
                proptest::collection::vec(any::<u64>(), 0..3),
                proptest::collection::vec(any::<u64>(), 0..3),
                any::<bool>(),
            )),
        )
            .prop_map(|(pickle, buffers, shm)| Value {
                pickle: pickle.into(),
                buffers: buffers.into_iter().map(Into::into).collect(),
                shm: shm.map(|(name, offsets, lengths, pooled)| ShmRef {
                    name,
                    offsets,
                    lengths,
                    pooled,
                }),
            }),
    )
}

fn arb_request() -> impl Strategy<Value = CallRequest> {
    (-2i32..16, "[a-z_]{0,8}", arb_value(), any::<bool>()).prop_map(|(op, name, value, shm)| {
        CallRequest {
            op,
            name,
            value,
            reply_shm: shm,
            ..Default::default()
        }
    })
}

fn arb_lengths() -> impl Strategy<Value = Vec<u64>> {
    proptest::collection::vec(
        prop_oneof![0u64..64, Just(u64::MAX), Just(1 << 40), any::<u64>()],
        0..5,
    )
}

fn arb_chunk() -> impl Strategy<Value = Chunk> {
    (
        proptest::option::of(arb_request()),
        arb_lengths(),
        proptest::collection::vec(any::<u8>(), 0..80),
    )
        .prop_map(|(request, lengths, data)| Chunk {
            request,
            lengths,
            data: data.into(),
            ..Default::default()
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// Arbitrary chunk sequences: the daemon answers each with a reply or a clean gRPC error, never crashes,
    /// and keeps serving a well-behaved master.
    #[test]
    fn arbitrary_chunk_streams_never_break_the_daemon(chunks in proptest::collection::vec(arb_chunk(), 0..5)) {
        let f = fixture();
        let address = f.address.clone();
        let outcome = f.rt.block_on(async move {
            let mut client =
                ddlf_proto::worker_client::WorkerClient::connect(format!("http://{address}")).await.unwrap();
            let reply = tokio::time::timeout(
                Duration::from_secs(5),
                client.call_stream(tokio_stream::iter(chunks)),
            )
            .await;
            match reply {
                Err(_) => Err("no answer within 5 s".to_string()),
                Ok(Err(status)) => Ok(Some(status.code())),
                Ok(Ok(resp)) => {
                    let mut s = resp.into_inner();
                    while let Ok(Some(_)) = s.message().await {}
                    Ok(None)
                }
            }
        });
        prop_assert!(outcome.is_ok(), "{:?}", outcome);
        let alive = f.rt.block_on(f.conn.ping(Some(Duration::from_secs(5))));
        prop_assert!(alive.is_ok(), "the daemon stopped answering: {:?}", alive);
    }

    /// Arbitrary bytes never make protobuf decoding of our messages panic.
    #[test]
    fn protobuf_decoding_of_random_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        use prost::Message;
        let _ = Chunk::decode(&bytes[..]);
        let _ = CallRequest::decode(&bytes[..]);
        let _ = Value::decode(&bytes[..]);
        let _ = ddlf_proto::HelloRequest::decode(&bytes[..]);
    }
}
