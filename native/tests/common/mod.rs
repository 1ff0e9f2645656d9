//! What the integration tests share: a loopback connection, as a client's end and the
//! server's end the reactors take over.

use std::io::Read;
use std::net::{TcpListener, TcpStream};
use std::os::fd::OwnedFd;
use std::time::Duration;

/// A connected pair: the client's end (blocking, 5 s reads), and the server's end as a
/// non-blocking owned socket.
pub fn pair() -> (TcpStream, OwnedFd) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (server, _) = listener.accept().unwrap();
    server.set_nonblocking(true).unwrap();
    client
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    (client, OwnedFd::from(server))
}

pub fn read_exact(client: &mut TcpStream, n: usize) -> Vec<u8> {
    let mut buf = vec![0; n];
    client.read_exact(&mut buf).unwrap();
    buf
}
