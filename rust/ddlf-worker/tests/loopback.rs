//! The daemon's network side against a Rust stand-in for the interpreter thread, on loopback.

use std::time::Duration;

use ddlf_core::auth::Token;
use ddlf_net::{ClientConfig, NetError, ServerConfig, WorkerConn};
use ddlf_proto::{CallReply, CallRequest, Op, Refusal, Value};
use ddlf_worker::{Daemon, DaemonConfig, JobReceiver, Next};

/// Echoes the request's value; `sleep` ops make the interpreter busy for the given milliseconds.
fn echo_interpreter(rx: JobReceiver) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let mut served = 0;
        loop {
            match rx.next(Duration::from_millis(20)) {
                Next::Job(job) => {
                    if job.request.name == "sleep" {
                        std::thread::sleep(Duration::from_millis(300));
                    }
                    let value = job.request.value.clone();
                    job.respond(CallReply {
                        value,
                        ..Default::default()
                    });
                    served += 1;
                }
                Next::Idle => {}
                Next::Shutdown => return served,
            }
        }
    })
}

fn start(token: Option<&str>, max_message_size: usize) -> (Daemon, std::thread::JoinHandle<u64>) {
    let (daemon, rx) = Daemon::start(DaemonConfig {
        listen: "127.0.0.1:0".into(),
        token: token.and_then(Token::new),
        server: ServerConfig {
            max_message_size,
            ..Default::default()
        },
        ..Default::default()
    })
    .unwrap();
    (daemon, echo_interpreter(rx))
}

fn client_config(token: Option<&str>) -> ClientConfig {
    ClientConfig {
        token: token.and_then(Token::new),
        connect_timeout: Duration::from_secs(2),
        ..Default::default()
    }
}

fn run_request(name: &str, payload: &[u8]) -> CallRequest {
    CallRequest {
        op: Op::Run as i32,
        name: name.into(),
        value: Some(Value {
            pickle: payload.to_vec().into(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn call_round_trip_and_auth() {
    let (daemon, interp) = start(Some("secret"), 1 << 20);
    let addr = daemon.local_addr().to_string();

    let conn = WorkerConn::connect(&addr, &client_config(Some("secret")))
        .await
        .unwrap();
    assert_eq!(conn.hello().protocol_version, ddlf_proto::PROTOCOL_VERSION);
    let reply = conn.call(run_request("f", b"hello"), None).await.unwrap();
    assert_eq!(&reply.value.unwrap().pickle[..], b"hello");

    // Wrong token and no token are refused at the handshake, before anything runs.
    for bad in [Some("wrong"), None] {
        match WorkerConn::connect(&addr, &client_config(bad)).await {
            Err(NetError::Unauthenticated { address, .. }) => assert_eq!(address, addr),
            Err(e) => panic!("expected Unauthenticated, got {e}"),
            Ok(_) => panic!("expected Unauthenticated, got a connection"),
        }
    }
    let status = conn.status(None).await.unwrap();
    assert_eq!(status.requests_served, 1);
    assert_eq!(status.requests_rejected, 2);

    // Oversized requests are refused and the worker keeps serving.
    let big = vec![7u8; 2 << 20];
    match conn.call(run_request("f", &big), None).await {
        Err(NetError::Refused {
            refusal, message, ..
        }) => {
            assert_eq!(refusal, Refusal::TooLarge);
            assert!(message.contains("1048576 bytes"), "{message}");
        }
        other => panic!("expected Rejected, got {:?}", other.map(|_| ())),
    }
    let reply = conn.call(run_request("f", b"still"), None).await.unwrap();
    assert_eq!(&reply.value.unwrap().pickle[..], b"still");

    // An unknown op code is refused.
    let mut bad = run_request("f", b"x");
    bad.op = 999;
    assert!(matches!(
        conn.call(bad, None).await,
        Err(NetError::Refused {
            refusal: Refusal::Malformed,
            ..
        })
    ));

    conn.shutdown(Some(Duration::from_secs(2))).await.unwrap();
    tokio::task::spawn_blocking(move || {
        assert_eq!(interp.join().unwrap(), 2);
        daemon.stop(Duration::from_secs(1));
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ping_and_status_answer_while_interpreter_is_busy() {
    let (daemon, _interp) = start(None, 1 << 20);
    let addr = daemon.local_addr().to_string();
    let conn = WorkerConn::connect(&addr, &client_config(None))
        .await
        .unwrap();
    let busy = {
        let conn = conn.clone();
        tokio::spawn(async move { conn.call(run_request("sleep", b""), None).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    let rtt = conn.ping(Some(Duration::from_millis(200))).await.unwrap();
    assert!(rtt < Duration::from_millis(200));
    let status = conn.status(Some(Duration::from_millis(200))).await.unwrap();
    assert_eq!(status.running, "run:sleep");
    // A deadline shorter than the work gives DeadlineExceeded, not a hang.
    let err = conn
        .call(run_request("sleep", b""), Some(Duration::from_millis(50)))
        .await
        .unwrap_err();
    assert!(matches!(err, NetError::DeadlineExceeded { .. }), "{err}");
    busy.await.unwrap().unwrap();
    tokio::task::spawn_blocking(move || daemon.stop(Duration::from_secs(1)))
        .await
        .unwrap();
}

#[tokio::test]
async fn unreachable_worker_is_reported_with_its_address() {
    // Bind then drop, so the port is (almost certainly) closed.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    match WorkerConn::connect(&addr, &client_config(None)).await {
        Err(NetError::Unavailable { address, .. }) => assert_eq!(address, addr),
        Err(e) => panic!("expected Unavailable, got {e}"),
        Ok(_) => panic!("expected Unavailable, got a connection"),
    }
}

#[test]
fn non_loopback_without_token_is_refused() {
    let err = Daemon::start(DaemonConfig {
        listen: "0.0.0.0:0".into(),
        ..Default::default()
    })
    .err()
    .expect("must refuse");
    assert!(err.to_string().contains("--insecure"));
    // With --insecure it starts.
    let (daemon, _rx) = Daemon::start(DaemonConfig {
        listen: "0.0.0.0:0".into(),
        insecure: true,
        ..Default::default()
    })
    .unwrap();
    daemon.stop(Duration::from_millis(100));
}

/// Send hand-made chunk streams through a raw client, bypassing the well-behaved splitter.
async fn raw_stream(
    addr: &str,
    chunks: Vec<ddlf_proto::Chunk>,
) -> Result<Vec<ddlf_proto::Chunk>, tonic::Status> {
    let mut client = ddlf_proto::worker_client::WorkerClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    let mut stream = client
        .call_stream(tokio_stream::iter(chunks))
        .await?
        .into_inner();
    let mut out = Vec::new();
    while let Some(c) = stream.message().await? {
        out.push(c);
    }
    Ok(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_streams_are_refused_and_the_worker_keeps_serving() {
    use ddlf_proto::Chunk;
    let (daemon, _interp) = start(None, 1000);
    let addr = daemon.local_addr().to_string();
    let header = |lengths: Vec<u64>| Chunk {
        request: Some(run_request("f", b"")),
        lengths,
        ..Default::default()
    };
    let data = |n: usize| Chunk {
        data: vec![1u8; n].into(),
        ..Default::default()
    };
    // Declared larger than the limit: refused before anything is allocated or read.
    let err = raw_stream(&addr, vec![header(vec![10, 5000])])
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err}");
    // Overflowing declared sizes.
    let err = raw_stream(&addr, vec![header(vec![u64::MAX, 2])])
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err}");
    // Truncated: 10 declared, 5 sent.
    let err = raw_stream(&addr, vec![header(vec![10]), data(5)])
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("ended after 5 of 10"), "{err}");
    // More data than declared.
    let err = raw_stream(&addr, vec![header(vec![3]), data(4)])
        .await
        .unwrap_err();
    assert!(err.message().contains("more bytes"), "{err}");
    // No header, and an empty stream.
    let err = raw_stream(&addr, vec![data(4)]).await.unwrap_err();
    assert!(err.message().contains("no request"), "{err}");
    let err = raw_stream(&addr, vec![]).await.unwrap_err();
    assert!(err.message().contains("empty"), "{err}");
    // A well-formed stream still works, split into several chunks.
    let reply = raw_stream(&addr, vec![header(vec![4, 3]), data(2), data(5)])
        .await
        .unwrap();
    assert_eq!(reply[0].lengths, vec![4, 3]);
    let body: Vec<u8> = reply[1..].iter().flat_map(|c| c.data.to_vec()).collect();
    assert_eq!(body, vec![1u8; 7]);
    tokio::task::spawn_blocking(move || daemon.stop(Duration::from_secs(1)))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_values_stream_in_chunks_both_ways() {
    let (daemon, _interp) = start(None, 64 << 20);
    let addr = daemon.local_addr().to_string();
    let conn = WorkerConn::connect(&addr, &client_config(None))
        .await
        .unwrap();
    let big: Vec<u8> = (0..20_000_000u32).map(|i| (i % 251) as u8).collect();
    let mut req = run_request("f", b"p");
    req.value.as_mut().unwrap().buffers =
        vec![big.clone().into(), bytes::Bytes::from_static(b"tail")];
    let reply = conn.call_stream(req, None, 1 << 20).await.unwrap();
    let value = reply.value.unwrap();
    assert_eq!(&value.pickle[..], b"p");
    assert_eq!(value.buffers[0].len(), big.len());
    assert!(value.buffers[0] == big);
    assert_eq!(&value.buffers[1][..], b"tail");
    tokio::task::spawn_blocking(move || daemon.stop(Duration::from_secs(1)))
        .await
        .unwrap();
}

fn start_guarded(
    guard: ddlf_net::GuardConfig,
) -> (Daemon, std::thread::JoinHandle<u64>, std::net::SocketAddr) {
    let (daemon, rx) = Daemon::start(DaemonConfig {
        listen: "127.0.0.1:0".into(),
        server: ServerConfig {
            guard,
            ..Default::default()
        },
        ..Default::default()
    })
    .unwrap();
    let addr = daemon.local_addr();
    (daemon, echo_interpreter(rx), addr)
}

/// Send `bytes` on a fresh connection and report whether the daemon closed it within 2 s.
async fn closed_after(addr: std::net::SocketAddr, bytes: &[u8]) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let _ = s.write_all(bytes).await;
    let mut buf = [0u8; 64];
    matches!(
        tokio::time::timeout(Duration::from_secs(2), s.read(&mut buf)).await,
        Ok(Ok(0)) | Ok(Err(_))
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_on_the_port_is_refused_and_the_worker_keeps_serving() {
    let (daemon, _interp, addr) = start_guarded(ddlf_net::GuardConfig {
        handshake_timeout: Duration::from_millis(300),
        ..Default::default()
    });
    let conn = WorkerConn::connect(&addr.to_string(), &client_config(None))
        .await
        .unwrap();
    let tls_client_hello = [0x16, 0x03, 0x01, 0x00, 0x05, 0x01, 0x00, 0x00, 0x01, 0x00];
    let cases: [&[u8]; 4] = [
        b"\x00\xde\xad\xbe\xef random bytes \xff\xfe",
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        &tls_client_hello,
        b"PRI * HTTP/2.0\r\n", // half a preface, then silence: a half-open connection
    ];
    for bytes in cases {
        assert!(closed_after(addr, bytes).await, "not closed: {bytes:?}");
        // The real master is unaffected.
        let reply = conn
            .call(
                run_request("f", b"still here"),
                Some(Duration::from_secs(5)),
            )
            .await
            .unwrap();
        assert_eq!(&reply.value.unwrap().pickle[..], b"still here");
    }
    // A connection that sends nothing at all is closed after the handshake deadline.
    assert!(closed_after(addr, b"").await);
    assert_eq!(
        daemon
            .state()
            .connections
            .refused
            .load(std::sync::atomic::Ordering::Relaxed),
        5
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_over_the_limit_are_refused() {
    // Each master opens two connections: gRPC and its direct lane.
    let (daemon, _interp, addr) = start_guarded(ddlf_net::GuardConfig {
        max_connections: 4,
        ..Default::default()
    });
    let a = WorkerConn::connect(&addr.to_string(), &client_config(None))
        .await
        .unwrap();
    let _b = WorkerConn::connect(&addr.to_string(), &client_config(None))
        .await
        .unwrap();
    let third = WorkerConn::connect(&addr.to_string(), &client_config(None)).await;
    assert!(third.is_err(), "a third connection was admitted");
    a.ping(Some(Duration::from_secs(2))).await.unwrap();
    let st = a.status(Some(Duration::from_secs(2))).await.unwrap();
    assert_eq!(st.connections_open, 4);
    assert!(st.connections_refused >= 1);
    drop(a);
    drop(_b);
    // Slots are released when connections close: a new master gets in.
    let mut ok = false;
    for _ in 0..50 {
        if WorkerConn::connect(&addr.to_string(), &client_config(None))
            .await
            .is_ok()
        {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(ok);
    drop(daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_daemon_refuses_requests_meant_for_its_predecessor() {
    let (daemon, _interp) = start(None, 1 << 20);
    let addr = daemon.local_addr().to_string();
    let conn = WorkerConn::connect(&addr, &client_config(None))
        .await
        .unwrap();
    let (_, instance) = conn.heartbeat(None).await.unwrap();
    assert_eq!(instance, conn.hello().instance);
    drop(daemon);
    // A new daemon on the same port: the old connection's calls must not run there.
    let (daemon2, rx) = Daemon::start(DaemonConfig {
        listen: addr.clone(),
        ..Default::default()
    })
    .unwrap();
    let _interp2 = echo_interpreter(rx);
    let mut outcome = None;
    for _ in 0..40 {
        match conn
            .call(run_request("f", b"x"), Some(Duration::from_secs(2)))
            .await
        {
            Err(NetError::Unavailable { .. }) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => {
                outcome = Some(other);
                break;
            }
        }
    }
    assert!(
        matches!(outcome, Some(Err(NetError::Restarted { .. }))),
        "{outcome:?}"
    );
    // A fresh connection is provisioned for the new instance and works.
    let fresh = WorkerConn::connect(&addr, &client_config(None))
        .await
        .unwrap();
    assert_ne!(fresh.hello().instance, conn.hello().instance);
    fresh
        .call(run_request("f", b"x"), Some(Duration::from_secs(2)))
        .await
        .unwrap();
    drop(daemon2);
}

/// One blocking call on a connection's direct lane.
fn lane_call(conn: &WorkerConn, req: CallRequest) -> Result<CallReply, NetError> {
    let mut call = conn.lane().expect("a free direct lane");
    let deadline = Some((
        std::time::Instant::now() + Duration::from_secs(5),
        Duration::from_secs(5),
    ));
    let mut wait = ddlf_net::lane::deadline_wait(deadline, || Ok(()));
    call.send(req, deadline, &mut wait)?;
    call.receive(deadline, &mut wait)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_lanes_call_refuse_and_authenticate() {
    let (daemon, interp) = start(Some("secret"), 1 << 20);
    let addr = daemon.local_addr().to_string();
    let conn = WorkerConn::connect(&addr, &client_config(Some("secret")))
        .await
        .unwrap();
    assert!(conn.has_lane());
    let busy = conn.clone();
    // The interpreter is busy with a gRPC call: the lane's request waits its turn and is then answered.
    let sleeper = tokio::spawn(async move {
        busy.call(run_request("sleep", b"z"), Some(Duration::from_secs(5)))
            .await
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let conn2 = conn.clone();
    tokio::task::spawn_blocking(move || {
        let conn = conn2;
        let reply = lane_call(&conn, run_request("f", b"over the lane")).unwrap();
        assert_eq!(&reply.value.unwrap().pickle[..], b"over the lane");
        // Too large for this worker (1 MiB): refused as over gRPC, and the lane stays open and in step.
        match lane_call(&conn, run_request("f", &vec![1u8; 3 << 19])) {
            Err(NetError::Refused {
                refusal, message, ..
            }) => {
                assert_eq!(refusal, Refusal::TooLarge);
                assert!(
                    message.contains("exceeds the limit of 1048576 bytes"),
                    "{message}"
                );
            }
            other => panic!("expected Rejected, got {:?}", other.map(|_| ())),
        }
        let mut bad = run_request("f", b"x");
        bad.op = 999;
        assert!(matches!(
            lane_call(&conn, bad),
            Err(NetError::Refused {
                refusal: Refusal::Malformed,
                ..
            })
        ));
        let reply = lane_call(&conn, run_request("f", b"still")).unwrap();
        assert_eq!(&reply.value.unwrap().pickle[..], b"still");
    })
    .await
    .unwrap();
    sleeper.await.unwrap().unwrap();

    // A lane without the token, or with a wrong one, is refused at its hello.
    for bad in [None, Token::new("wrong")] {
        let limits = ddlf_core::frame::FrameLimits::default();
        match ddlf_net::lane::Lane::open(
            &addr,
            bad.as_ref(),
            Duration::from_secs(2),
            limits,
            Duration::ZERO,
        )
        .await
        {
            Err(NetError::Unauthenticated { reason, .. }) => {
                assert!(reason.contains("token"), "{reason}");
            }
            other => panic!("expected a refusal, got {:?}", other.map(|_| ())),
        }
    }
    // A lane preface followed by garbage is closed; the real master is unaffected.
    let mut hello = ddlf_net::preface::LANE_PREFACE.to_vec();
    hello.extend_from_slice(&[0xff; 4]);
    assert!(closed_after(daemon.local_addr(), &hello).await);
    let reply = conn.call(run_request("f", b"grpc"), None).await.unwrap();
    assert_eq!(&reply.value.unwrap().pickle[..], b"grpc");

    let status = conn.status(None).await.unwrap();
    assert_eq!(status.requests_rejected, 4); // too large, bad op, two bad tokens
    conn.shutdown(Some(Duration::from_secs(2))).await.unwrap();
    tokio::task::spawn_blocking(move || {
        assert_eq!(interp.join().unwrap(), 4); // sleep, two lane calls, one gRPC call
        daemon.stop(Duration::from_secs(1));
    })
    .await
    .unwrap();
}
