// Package faultproxy is a loopback TCP proxy that injects real network faults
// between a gRPC client and server talking HTTP/2 over plain TCP (h2c, no
// TLS). Tests and demos of the idempotency library use it to show what
// happens when a response is lost after the server has already committed the
// request, when a request is delivered twice, and when the network is slow.
//
// # How a dropped response is detected
//
// gRPC multiplexes many RPCs over one HTTP/2 connection, so a fault cannot be
// aimed at a single RPC without understanding the framing. The proxy parses
// HTTP/2 frame headers (9 bytes: 24-bit length, type, flags, 31-bit stream
// id) in both directions. On the server-to-client side, the first HEADERS or
// DATA frame on a non-zero stream id marks the start of a response stream;
// SETTINGS, SETTINGS ACK, PING, WINDOW_UPDATE, GOAWAY and RST_STREAM frames
// are never treated as responses. One drop decision is made per response
// stream. When the decision is "drop", the proxy flushes what it already
// forwarded and closes both the client and the server side of the TCP
// connection instead of forwarding that frame. The client then fails the RPC
// with codes.Unavailable and reconnects on the next call.
//
// For unary gRPC handlers the server sends no response HEADERS until the
// handler has returned, so a dropped response proves the handler already ran.
// A streaming handler that sends headers early would be cut before it
// finished; the fault is then "connection lost mid-call" rather than
// "response lost after commit".
//
// # How a duplicate request is produced
//
// HTTP/2 header blocks are HPACK-compressed against a dynamic table that the
// client builds over the life of the connection, so a single request cannot
// be copied onto another connection on its own. Instead the proxy records the
// client's connection preface, its SETTINGS frames and every header block
// (HEADERS plus CONTINUATION frames), plus the DATA frames of the streams
// chosen for duplication. When a chosen request stream ends (END_STREAM), the
// proxy opens a fresh upstream connection and replays: the preface, the
// SETTINGS, every recorded header block in its original order, and the
// chosen stream's DATA. Header blocks of other streams are replayed so the
// server's HPACK decoder reaches the same state, but their END_STREAM flag is
// cleared and each is followed by RST_STREAM(CANCEL), so the server discards
// those streams without invoking a unary handler. The proxy answers the
// server's SETTINGS and PING on that connection, reads and discards its
// response until the chosen stream ends, and then closes it. The client only
// ever sees the response from its own connection.
//
// # Outages
//
// SetRefusing and CutAll work on TCP connections of any protocol, so they
// can stand between a server and its database as well as between a client
// and a server: SetRefusing(true) resets every new connection on arrival
// (the target looks down), and CutAll closes every open connection on both
// sides (a network failure, or the target restarting). Together they make a
// database outage of any length without touching the database itself.
//
// # Determinism
//
// Drop decisions come from a PCG generator (math/rand/v2) seeded with the
// seed, and duplicate decisions from a second, independent PCG generator
// seeded with the same seed; exactly one value is drawn per response stream
// and per request stream respectively, whatever the configured rates, and
// even when DropNextResponse forces a drop. With a single client issuing
// calls one at a time the sequence of decisions is therefore reproducible.
// With concurrent calls or several connections the decisions are assigned to
// streams in the order their frames reach the proxy, which is not
// reproducible.
//
// # Limitations
//
//   - Only HTTP/2 with prior knowledge (h2c) is understood. A connection that
//     does not start with the HTTP/2 client preface is relayed untouched,
//     without the HTTP/2 faults (the delay, SetRefusing and CutAll still
//     apply). Nothing is relayed from the
//     server until the client has sent its first byte, so protocols where
//     the server speaks first are not supported.
//   - A drop closes the whole TCP connection, so every other RPC in flight on
//     that connection fails too, whether or not the server processed it.
//     gRPC fails those with codes.Unavailable, or with a bare io.EOF when
//     the cut came before the call had written its request.
//   - Duplicates are best effort. Recording stops for a connection once it has
//     kept about 1 MiB, after which no request on that connection is
//     duplicated. A duplicated request larger than the server's initial flow
//     control window (64 KiB by default) may be refused by the server, since
//     the replay is sent without waiting for WINDOW_UPDATE. Client trailers
//     (which gRPC never sends) are not handled. The duplicate may reach the
//     handler before or after the original; callers should wait for it
//     (for example by polling a counter) rather than assume an order.
//   - The delay holds every chunk read from the client for the configured
//     duration before forwarding it, so it adds at least that much latency
//     per request and also limits client-to-server throughput.
package faultproxy
