//! A key-value store over RDMA on tokio: the server registers 1 MiB of slots and then
//! only waits; the client stores and fetches values in those slots with one-sided RDMA
//! WRITE and READ, versions each slot with FETCH_AND_ADD, and ends the session with a
//! SEND. Every completion is awaited (no thread blocks), both sides run as tasks of one
//! current-thread runtime, each with its own device over loopback UDP, connected through
//! the connection manager.
//!
//! ```text
//! cargo run --example async_kv --features tokio [-- --keys 500]
//! ```
//!
//! A slot is 256 bytes: the version (u64, native-endian, the FETCH_AND_ADD target), then
//! the key (u64), the value's length (u64) and up to 232 bytes of value. A key's slot is
//! `hash(key) % slots`; a slot holding another key is skipped (linear probing), which
//! the client finds by READing the slot first, as a client of a real store would.
//! A writer bumps the version before and after writing (odd: being written), so a reader
//! that sees an odd version, or a version that changed across its READ, reads again.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use softrdma::cm::{self, AcceptOptions, AsyncListener, ConnectOptions};
use softrdma::{
    wr, Access, AsyncCompletionQueue, Device, DeviceAddr, DeviceConfig, MemoryRegion, QpInit,
    QpType, RemoteMemory, WcOpcode, WorkCompletion,
};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// The server's store: 1 MiB of 256-byte slots.
const STORE: usize = 1 << 20;
const SLOT: usize = 256;
const SLOTS: u64 = (STORE / SLOT) as u64;
/// Where a slot's fields sit.
const VERSION: usize = 0;
const KEY: usize = 8;
const LEN: usize = 16;
const VALUE: usize = 24;
const MAX_VALUE: usize = SLOT - VALUE;
/// The SEND that ends the session.
const BYE: &[u8] = b"bye";

fn device(name: &str) -> Res<Device> {
    // Two devices in one process: each takes its own 127.0.0.x.
    Ok(Device::open_with(&DeviceConfig::new(
        name,
        DeviceAddr::AutoLoopback(4791),
    ))?)
}

/// The slot a key starts probing at (FNV-1a of its bytes).
fn home(key: u64) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in key.to_le_bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    h % SLOTS
}

fn value_of(key: u64, round: u64) -> Vec<u8> {
    let len = 16 + (key as usize * 13) % (MAX_VALUE - 16);
    (0..len)
        .map(|i| (key as usize * 7 + i * 3 + round as usize) as u8)
        .collect()
}

/// The server: registers the store, accepts one client (its private data answers with
/// the store's address and rkey), and awaits the client's SEND. It never touches the
/// store meanwhile: the client's operations are one-sided.
async fn server(dev: Device, listener: AsyncListener) -> Res<MemoryRegion> {
    let pd = dev.alloc_pd()?;
    let channel = dev.create_channel()?;
    let cq = dev.create_cq(128, Some(&channel))?;
    let store = pd.register(
        STORE,
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC,
    )?;
    let inbox = pd.register(64, Access::LOCAL_WRITE)?;
    let conn = listener
        .accept_with(
            &pd,
            &QpInit::new(QpType::Rc, &cq),
            &AcceptOptions::new(&store.remote().to_bytes()),
            // The receive for the client's SEND, posted before the client can send.
            |qp| qp.post_recv(wr::recv(1, [inbox.sge(..)?])),
        )
        .await?;
    println!("server: client connected from {:?}", conn.peer_addr());
    let mut cq = cq.into_async()?;
    let wc = cq.completion().await?;
    wc.result()?;
    if wc.opcode != WcOpcode::Recv || inbox.to_vec(0, wc.byte_len as usize)? != BYE {
        return Err(format!("server: unexpected message {wc:?}").into());
    }
    println!("server: client said bye");
    conn.disconnected().await?;
    Ok(store)
}

/// The client's side of the store: a connected QP, its async CQ, a scratch region for
/// the bytes that go out and come back, and the store's remote address.
struct Client {
    conn: cm::Connection,
    cq: AsyncCompletionQueue,
    scratch: MemoryRegion,
    store: RemoteMemory,
    ops: u64,
}

impl Client {
    /// Await the completion of the one operation just posted.
    async fn done(&mut self, op: WcOpcode) -> Res<WorkCompletion> {
        let wc = self.cq.completion().await?;
        wc.result()?;
        if wc.opcode != op {
            return Err(format!("expected {op:?}, got {wc:?}").into());
        }
        self.ops += 1;
        Ok(wc)
    }

    /// READ slot `s` into the scratch region's first 256 bytes.
    async fn read_slot(&mut self, s: u64) -> Res<()> {
        let w = wr::read(
            1,
            [self.scratch.sge(0..SLOT)?],
            &self.store,
            s * SLOT as u64,
        )?;
        self.conn.qp().post_send(w)?;
        self.done(WcOpcode::RdmaRead).await?;
        Ok(())
    }

    /// FETCH_AND_ADD 1 to slot `s`'s version; the old version.
    async fn bump(&mut self, s: u64) -> Res<u64> {
        let at = s * SLOT as u64 + VERSION as u64;
        let w = wr::fetch_add(2, self.scratch.sge(SLOT..SLOT + 8)?, &self.store, at, 1)?;
        self.conn.qp().post_send(w)?;
        self.done(WcOpcode::FetchAdd).await?;
        // The old value lands in our memory as the u64 it was in the server's.
        Ok(self.scratch.read_u64(SLOT)?)
    }

    /// The slot that holds `key`, or the first free one on its probe path.
    async fn find(&mut self, key: u64) -> Res<(u64, bool)> {
        for i in 0..SLOTS {
            let s = (home(key) + i) % SLOTS;
            self.read_slot(s).await?;
            let version = self.scratch.read_u64(VERSION)?;
            let k = self.scratch.read_u64(KEY)?;
            if version == 0 {
                return Ok((s, false));
            }
            if k == key {
                return Ok((s, true));
            }
        }
        Err("the store is full".into())
    }

    /// Store `value` under `key`: find the slot, make its version odd, WRITE key, length
    /// and value, make it even again. Returns the slot's version after the write.
    async fn put(&mut self, key: u64, value: &[u8]) -> Res<u64> {
        let (s, _) = self.find(key).await?;
        let v = self.bump(s).await?;
        let off = SLOT + 64;
        self.scratch.write_u64(off, key)?;
        self.scratch.write_u64(off + 8, value.len() as u64)?;
        self.scratch.write(off + 16, value)?;
        let len = 16 + value.len();
        let w = wr::write(
            3,
            [self.scratch.sge(off..off + len)?],
            &self.store,
            s * SLOT as u64 + KEY as u64,
        )?;
        self.conn.qp().post_send(w)?;
        self.done(WcOpcode::RdmaWrite).await?;
        self.bump(s).await?;
        Ok(v + 2)
    }

    /// The value under `key`, read consistently (version even and unchanged).
    async fn get(&mut self, key: u64) -> Res<Option<(u64, Vec<u8>)>> {
        loop {
            let (s, found) = self.find(key).await?;
            if !found {
                return Ok(None);
            }
            let version = self.scratch.read_u64(VERSION)?;
            let len = self.scratch.read_u64(LEN)? as usize;
            if version % 2 == 1 || len > MAX_VALUE {
                continue; // being written
            }
            let value = self.scratch.to_vec(VALUE, len)?;
            // READ the version again: unchanged means the value was not torn.
            self.read_slot(s).await?;
            if self.scratch.read_u64(VERSION)? == version {
                return Ok(Some((version, value)));
            }
        }
    }
}

async fn client(dev: Device, server: SocketAddr, keys: u64) -> Res<()> {
    let pd = dev.alloc_pd()?;
    let channel = dev.create_channel()?;
    let cq = dev.create_cq(128, Some(&channel))?;
    let scratch = pd.register(4096, Access::LOCAL_WRITE)?;
    let conn = cm::connect_async(
        &pd,
        &QpInit::new(QpType::Rc, &cq),
        server,
        &ConnectOptions::new(b"kv"),
    )
    .await?;
    let mut rb = [0u8; 20];
    rb.copy_from_slice(&conn.private_data()[..20]);
    let mut c = Client {
        conn,
        cq: cq.into_async()?,
        scratch,
        store: RemoteMemory::from_bytes(&rb),
        ops: 0,
    };
    let t = Instant::now();
    // Two rounds of puts, so every slot's version moves 0 -> 2 -> 4.
    for round in 0..2 {
        for key in 1..=keys {
            let v = c.put(key, &value_of(key, round)).await?;
            if v != 2 * (round + 1) {
                return Err(format!("key {key}: version {v} after round {round}").into());
            }
        }
    }
    for key in 1..=keys {
        match c.get(key).await? {
            Some((4, v)) if v == value_of(key, 1) => {}
            other => return Err(format!("key {key}: got {other:?}").into()),
        }
    }
    if c.get(keys + 1).await?.is_some() {
        return Err("a key never stored was found".into());
    }
    println!(
        "client: {keys} keys put twice and read back, {} RDMA operations awaited in {:.0?}",
        c.ops,
        t.elapsed()
    );
    c.scratch.write(0, BYE)?;
    c.conn
        .qp()
        .post_send(wr::send(9, [c.scratch.sge(0..BYE.len())?]))?;
    c.done(WcOpcode::Send).await?;
    c.conn.disconnect()?;
    Ok(())
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Res<()> {
    let mut keys = 300;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--keys" => keys = args.next().ok_or("--keys N")?.parse()?,
            "--self-test" => {} // the default run checks itself
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    if keys == 0 || keys >= SLOTS {
        return Err(format!("--keys must be 1..{SLOTS}").into());
    }
    let srv_dev = device("kv-server")?;
    let cli_dev = device("kv-client")?;
    // Port 0: the CM picks a free port, so runs do not collide.
    let listener = AsyncListener::bind(&srv_dev, "0.0.0.0:0".parse()?)?;
    let addr = SocketAddr::from(([127, 0, 0, 1], listener.local_addr().port()));
    println!(
        "server {} at {}, client {} at {}; store on CM port {}",
        srv_dev.name(),
        srv_dev.addr(),
        cli_dev.name(),
        cli_dev.addr(),
        addr.port()
    );
    let run = async {
        let (store, done) = tokio::join!(server(srv_dev, listener), client(cli_dev, addr, keys));
        done?;
        let store = store?;
        // The server checks its own memory: what the client's one-sided operations left.
        for key in 1..=keys {
            let found = (0..SLOTS)
                .map(|i| (home(key) + i) % SLOTS)
                .find(|&s| store.read_u64(s as usize * SLOT + KEY).ok() == Some(key));
            let s = found.ok_or_else(|| format!("server: key {key} not in the store"))? as usize;
            let value = value_of(key, 1);
            let at = s * SLOT;
            if store.read_u64(at + VERSION)? != 4
                || store.read_u64(at + LEN)? != value.len() as u64
                || store.to_vec(at + VALUE, value.len())? != value
            {
                return Err(format!("server: slot {s} of key {key} is wrong").into());
            }
        }
        println!("server: all {keys} keys found in the store with version 4 and their values");
        Ok::<(), Box<dyn std::error::Error>>(())
    };
    tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .map_err(|_| "the session did not finish in 120 s")??;
    println!("ok");
    Ok(())
}
