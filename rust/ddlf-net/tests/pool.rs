//! The master's pool against real daemons on loopback, each with a Rust stand-in for its interpreter thread.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use ddlf_core::auth::Token;
use ddlf_net::pool::{never, Call, Outcome, PoolError};
use ddlf_net::{ClientConfig, NetError, Outgoing, Pool};
use ddlf_proto::{CallReply, ErrorKind, Op, RemoteException, Value};
use ddlf_worker::{Daemon, DaemonConfig, JobReceiver, Next};

/// How long the `sleep` operation keeps the interpreter busy (long enough that a loaded machine still interrupts
/// or times out well before it ends).
const SLEEP: Duration = Duration::from_millis(1500);

/// What an interpreter saw: (request id, shared-memory segment name if any) per request.
type Seen = Arc<Mutex<Vec<(u64, Option<String>)>>>;

/// Echoes the request's value; `sleep` sleeps [`SLEEP`] first; `raise` answers as user code that raised.
fn interpreter(rx: JobReceiver, seen: Seen) {
    std::thread::spawn(move || loop {
        match rx.next(Duration::from_millis(20)) {
            Next::Job(job) => {
                let req = &job.request;
                let shm = req.value.as_ref().and_then(|v| v.shm.as_ref());
                seen.lock()
                    .unwrap()
                    .push((req.request_id, shm.map(|s| s.name.clone())));
                let reply = match req.name.as_str() {
                    "raise" => CallReply {
                        error: ErrorKind::User as i32,
                        exception: Some(RemoteException {
                            type_name: "ValueError".into(),
                            message: "no".into(),
                            traceback: "tb".into(),
                        }),
                        ..Default::default()
                    },
                    name => {
                        if name == "sleep" {
                            std::thread::sleep(SLEEP);
                        }
                        CallReply {
                            value: req.value.clone(),
                            compute_seconds: 0.001,
                            ..Default::default()
                        }
                    }
                };
                job.respond(reply);
            }
            Next::Idle => {}
            Next::Shutdown => return,
        }
    });
}

struct Workers {
    daemons: Vec<Daemon>,
    seen: Vec<Seen>,
    addresses: Vec<String>,
}

fn start(n: usize) -> Workers {
    let mut w = Workers {
        daemons: vec![],
        seen: vec![],
        addresses: vec![],
    };
    for _ in 0..n {
        let (daemon, rx) = Daemon::start(DaemonConfig {
            listen: "127.0.0.1:0".into(),
            token: Token::new("t"),
            ..Default::default()
        })
        .unwrap();
        let seen = Seen::default();
        interpreter(rx, seen.clone());
        w.addresses.push(daemon.local_addr().to_string());
        w.daemons.push(daemon);
        w.seen.push(seen);
    }
    w
}

fn config(shared_memory: bool) -> ClientConfig {
    ClientConfig {
        token: Token::new("t"),
        connect_timeout: Duration::from_secs(5),
        shared_memory,
        ..Default::default()
    }
}

fn run(name: &str) -> Call {
    Call {
        op: Op::Run as i32,
        name: name.into(),
        digest: String::new(),
    }
}

fn value(pickle: &[u8], buffers: Vec<Vec<u8>>) -> Outgoing {
    Outgoing::new(
        Bytes::copy_from_slice(pickle),
        buffers.into_iter().map(Bytes::from).collect(),
    )
}

/// Run `name` on worker 0 with the pickle `pickle` (no buffers), within `timeout`.
fn on_worker_0(
    pool: &Pool,
    name: &str,
    pickle: &[u8],
    timeout: Option<Duration>,
    interrupt: ddlf_net::pool::Interrupt<'_>,
) -> Result<Vec<ddlf_net::Answer>, PoolError> {
    pool.call(
        &[0],
        &run(name),
        vec![value(pickle, vec![])],
        &[0],
        timeout,
        interrupt,
    )
}

fn reply(outcome: &Outcome) -> &Value {
    match outcome {
        Outcome::Reply(v) => v,
        other => panic!("expected a reply, got {other:?}"),
    }
}

#[test]
fn one_value_reaches_every_worker_with_unique_ids() {
    let w = start(2);
    let pool = Pool::connect(&w.addresses, config(false), &never).unwrap();
    assert_eq!(pool.len(), 2);
    assert!(pool.connections().iter().all(|c| c.has_lane()));
    let answers = pool
        .call(
            &[0, 1],
            &run("f"),
            vec![value(b"hi", vec![])],
            &[0, 0],
            None,
            &never,
        )
        .unwrap();
    assert_eq!(answers.len(), 2);
    for (i, a) in answers.iter().enumerate() {
        assert_eq!(a.worker, i);
        assert_eq!(&reply(&a.outcome).pickle[..], b"hi");
        assert!(a.call_seconds > 0.0 && a.worker_seconds == 0.001);
    }
    assert_ne!(answers[0].request_id, answers[1].request_id);
    let again = pool
        .call(
            &[1],
            &run("f"),
            vec![value(b"x", vec![])],
            &[0],
            None,
            &never,
        )
        .unwrap();
    assert!(again[0].request_id > answers[1].request_id);
    // The ids the workers saw are the ids the answers carry.
    assert_eq!(w.seen[0].lock().unwrap()[0].0, answers[0].request_id);
}

#[test]
fn each_target_gets_its_own_value_and_large_ones_stream_over_grpc() {
    let w = start(2);
    let pool = Pool::connect(&w.addresses, config(false), &never).unwrap();
    let big = vec![7u8; 3 << 20]; // over a lane's 1 MiB: gRPC, streamed
    let values = vec![
        value(b"a", vec![big.clone()]),
        value(b"b", vec![vec![1, 2, 3]]),
    ];
    let answers = pool
        .call(&[1, 0], &run("f"), values, &[0, 1], None, &never)
        .unwrap();
    assert_eq!(answers[0].worker, 1);
    let v = reply(&answers[0].outcome);
    assert_eq!(&v.pickle[..], b"a");
    assert_eq!(v.buffers.concat(), big);
    assert_eq!(&reply(&answers[1].outcome).buffers[0][..], &[1, 2, 3]);
    // A value count that does not match is refused before anything is sent.
    let err = pool
        .call(
            &[0, 1],
            &run("f"),
            vec![value(b"", vec![])],
            &[0, 1],
            None,
            &never,
        )
        .unwrap_err();
    assert!(matches!(err, PoolError::ValueCount { .. }), "{err}");
}

#[test]
fn a_large_value_is_written_to_shared_memory_once_for_all_local_workers() {
    if !ddlf_core::shm::available() {
        eprintln!("no /dev/shm here: skipped");
        return;
    }
    let w = start(2);
    let pool = Pool::connect(&w.addresses, config(true), &never).unwrap();
    assert!(pool.connections().iter().all(|c| c.shared_memory()));
    let big = vec![3u8; 2 << 20];
    pool.call(
        &[0, 1],
        &run("f"),
        vec![value(b"p", vec![big])],
        &[0, 0],
        None,
        &never,
    )
    .unwrap();
    let names: Vec<Option<String>> = w
        .seen
        .iter()
        .map(|s| s.lock().unwrap()[0].1.clone())
        .collect();
    assert!(
        names[0].is_some(),
        "the value did not travel through shared memory"
    );
    assert_eq!(
        names[0], names[1],
        "one segment, written once, for both workers"
    );
    // A small value goes inline.
    pool.call(
        &[0],
        &run("f"),
        vec![value(b"p", vec![vec![1; 16]])],
        &[0],
        None,
        &never,
    )
    .unwrap();
    assert_eq!(w.seen[0].lock().unwrap()[1].1, None);
}

#[test]
fn a_failing_worker_never_hides_the_others_answers() {
    let w = start(3);
    let pool = Pool::connect(&w.addresses, config(false), &never).unwrap();
    pool.shutdown(&[2], Some(Duration::from_secs(2)), &never)
        .unwrap()
        .remove(0)
        .unwrap();
    // Wait until the daemon is gone (its heartbeat fails), however loaded the machine.
    let gone = Instant::now();
    while pool
        .heartbeat(&[2], Some(Duration::from_millis(200)), &never)
        .unwrap()[0]
        .is_ok()
    {
        assert!(
            gone.elapsed() < Duration::from_secs(10),
            "the daemon did not stop"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let calls = [run("f"), run("raise"), run("f")];
    let answers = pool
        .call(
            &[0, 1, 2],
            &calls[0],
            vec![value(b"ok", vec![])],
            &[0, 0, 0],
            None,
            &never,
        )
        .unwrap();
    assert_eq!(&reply(&answers[0].outcome).pickle[..], b"ok");
    assert!(
        matches!(&answers[2].outcome, Outcome::Failed(NetError::Unavailable { address, .. }) if *address == w.addresses[2]),
        "{:?}",
        answers[2].outcome
    );
    let raised = pool
        .call(
            &[1],
            &calls[1],
            vec![value(b"", vec![])],
            &[0],
            None,
            &never,
        )
        .unwrap();
    match &raised[0].outcome {
        Outcome::Remote {
            kind, type_name, ..
        } => {
            assert_eq!(*kind, ErrorKind::User);
            assert_eq!(type_name, "ValueError");
        }
        other => panic!("expected a remote error, got {other:?}"),
    }
    // Heartbeats: the live ones answer with their instance, the stopped one fails.
    let beats = pool
        .heartbeat(&[0, 2], Some(Duration::from_secs(2)), &never)
        .unwrap();
    assert!(beats[0].is_ok() && beats[1].is_err());
}

#[test]
fn an_interrupt_ends_the_wait_and_the_lane_comes_back() {
    let w = start(1);
    let pool = Pool::connect(&w.addresses, config(false), &never).unwrap();
    let fired = AtomicBool::new(false);
    let start = Instant::now();
    let interrupt = || -> io::Result<()> {
        if start.elapsed() > Duration::from_millis(100) {
            fired.store(true, Ordering::Relaxed);
            return Err(io::ErrorKind::Interrupted.into());
        }
        Ok(())
    };
    let err = on_worker_0(&pool, "sleep", b"", None, &interrupt).unwrap_err();
    assert!(matches!(err, PoolError::Interrupted), "{err}");
    assert!(fired.load(Ordering::Relaxed) && start.elapsed() < SLEEP - Duration::from_millis(200));
    // The lane's state was unknown, so it closed; the next call goes over gRPC (and waits for the sleeper),
    // and the worker's answer there opens the lane again.
    assert!(!pool.connections()[0].has_lane());
    let answers = on_worker_0(&pool, "f", b"1", None, &never).unwrap();
    assert_eq!(&reply(&answers[0].outcome).pickle[..], b"1");
    assert!(pool.connections()[0].has_lane());
}

#[test]
fn a_deadline_fails_the_call_not_the_pool() {
    let w = start(1);
    let pool = Pool::connect(&w.addresses, config(false), &never).unwrap();
    let answers = on_worker_0(
        &pool,
        "sleep",
        b"",
        Some(Duration::from_millis(100)),
        &never,
    )
    .unwrap();
    assert!(
        matches!(
            answers[0].outcome,
            Outcome::Failed(NetError::DeadlineExceeded { .. })
        ),
        "{:?}",
        answers[0].outcome
    );
    std::thread::sleep(SLEEP);
    let answers = on_worker_0(&pool, "f", b"2", None, &never).unwrap();
    assert_eq!(&reply(&answers[0].outcome).pickle[..], b"2");
}

#[test]
fn membership_changes_and_bad_indices() {
    let w = start(2);
    let pool = Pool::connect(&w.addresses[..1], config(false), &never).unwrap();
    assert!(matches!(
        pool.call(
            &[1],
            &run("f"),
            vec![value(b"", vec![])],
            &[0],
            None,
            &never
        ),
        Err(PoolError::NoSuchWorker { index: 1, len: 1 })
    ));
    assert_eq!(pool.add(w.addresses[1].clone(), None, &never).unwrap(), 1);
    let before = pool.connections()[1].hello().instance;
    let again = pool.reconnect(1, None, &never).unwrap();
    assert_eq!(
        again.hello().instance,
        before,
        "the same daemon: the same instance"
    );
    assert_eq!(pool.remove(0).unwrap(), w.addresses[0]);
    assert_eq!(pool.connections()[0].address(), w.addresses[1]);
    assert!(matches!(
        pool.remove(5),
        Err(PoolError::NoSuchWorker { .. })
    ));
    // Nothing listens at this address: connecting fails with the worker's index.
    let err = pool
        .add("127.0.0.1:1".into(), Some(Duration::from_secs(1)), &never)
        .unwrap_err();
    assert!(matches!(err, PoolError::Connect { index: 1, .. }), "{err}");
    assert!(matches!(
        Pool::connect(&[], config(false), &never),
        Err(PoolError::NoWorkers)
    ));
    drop(w.daemons);
}

#[test]
fn pings_ride_their_lane_and_are_answered_while_the_interpreter_is_busy() {
    let w = start(2);
    let pool = Pool::connect(&w.addresses, config(false), &never).unwrap();
    let conns = pool.connections();
    assert!(conns.iter().all(|c| c.has_ping_lane() && c.has_lane()));
    let instances: Vec<u64> = conns.iter().map(|c| c.hello().instance).collect();
    let done = AtomicBool::new(false);
    std::thread::scope(|s| {
        // Worker 0's interpreter sleeps in a call on its direct lane; its pings are answered meanwhile.
        s.spawn(|| {
            let answers = on_worker_0(&pool, "sleep", b"", None, &never).unwrap();
            assert!(matches!(answers[0].outcome, Outcome::Reply(_)));
            done.store(true, Ordering::SeqCst);
        });
        while w.seen[0].lock().unwrap().is_empty() {
            std::thread::sleep(Duration::from_millis(5));
        }
        for _ in 0..20 {
            let beats = pool
                .heartbeat(&[0, 1], Some(Duration::from_secs(5)), &never)
                .unwrap();
            let got: Vec<u64> = beats.iter().map(|b| b.as_ref().unwrap().1).collect();
            assert_eq!(got, instances);
        }
        assert!(
            !done.load(Ordering::SeqCst),
            "the pings waited for the interpreter's job"
        );
    });
    // Every one of them answered on its lane, none over gRPC.
    for d in &w.daemons {
        assert_eq!(d.state().lane_pings.load(Ordering::Relaxed), 20);
    }
    assert!(pool.connections().iter().all(|c| c.has_ping_lane()));
}

#[test]
fn a_stopped_daemon_fails_its_ping_and_a_restarted_one_answers_with_its_new_instance() {
    let mut w = start(2);
    let pool = Pool::connect(&w.addresses, config(false), &never).unwrap();
    let old = pool.connections()[1].hello().instance;
    let address = w.addresses[1].clone();
    w.daemons.pop().unwrap().stop(Duration::from_millis(100));
    let beats = pool
        .heartbeat(&[0, 1], Some(Duration::from_secs(2)), &never)
        .unwrap();
    assert!(beats[0].is_ok());
    assert!(
        matches!(beats[1], Err(NetError::Unavailable { .. })),
        "{:?}",
        beats[1]
    );
    assert!(!pool.connections()[1].has_ping_lane());
    // A new daemon at the same address: its ping lane is another's, so the answer comes over gRPC.
    let (daemon, rx) = Daemon::start(DaemonConfig {
        listen: address,
        token: Token::new("t"),
        ..Default::default()
    })
    .unwrap();
    interpreter(rx, Seen::default());
    let beats = pool
        .heartbeat(&[1], Some(Duration::from_secs(5)), &never)
        .unwrap();
    let instance = beats[0].as_ref().unwrap().1;
    assert_eq!(instance, daemon.state().instance);
    assert_ne!(instance, old);
    assert!(!pool.connections()[1].has_ping_lane());
}

#[test]
fn a_daemon_that_serves_no_ping_lanes_gets_its_lane_closed_unused() {
    use ddlf_net::lane::{handshake_bytes, PingLane};
    use ddlf_proto::LaneWelcome;
    use std::io::{Read, Write};
    // What a daemon from before ping lanes answers: a welcome for a call lane, whatever the hello asked for.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let old = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut preface = [0u8; 24];
        s.read_exact(&mut preface).unwrap();
        let mut len = [0u8; 4];
        s.read_exact(&mut len).unwrap();
        let mut hello = vec![0u8; u32::from_le_bytes(len) as usize];
        s.read_exact(&mut hello).unwrap();
        let welcome = LaneWelcome {
            protocol_version: ddlf_proto::PROTOCOL_VERSION,
            instance: 9,
            ..Default::default()
        };
        s.write_all(&handshake_bytes(&welcome)).unwrap();
        // The master closes the lane without sending anything on it.
        let mut rest = vec![];
        s.read_to_end(&mut rest).unwrap();
        rest
    });
    let rt = tokio::runtime::Runtime::new().unwrap();
    let err = rt
        .block_on(PingLane::open(
            &address,
            None,
            Duration::from_secs(5),
            Duration::ZERO,
        ))
        .unwrap_err();
    assert!(matches!(err, NetError::Unavailable { .. }), "{err}");
    assert!(err.to_string().contains("LANE_KIND_PING"), "{err}");
    assert!(old.join().unwrap().is_empty());
}
