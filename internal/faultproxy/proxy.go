package faultproxy

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

const (
	// dialTimeout bounds how long a client waits for the upstream dial, so a
	// dead target does not pin accepted connections.
	dialTimeout = 5 * time.Second
	// bufSize is large enough to carry a default-sized HTTP/2 frame (16 KiB)
	// plus its header in one buffered write.
	bufSize = 32 << 10
	// PCG stream selectors: drop and duplicate decisions use separate
	// generators so enabling one fault does not shift the other's sequence.
	pcgDropStream = 0x64726f70 // "drop"
	pcgDupStream  = 0x00647570 // "dup"
)

// Option configures a Proxy.
type Option func(*config)

type config struct {
	seed     int64
	dropRate float64
	dupRate  float64
	delay    time.Duration
}

// WithSeed sets the seed of the fault decision generators (default 0), so a
// run can be replayed exactly.
func WithSeed(seed int64) Option {
	return func(c *config) { c.seed = seed }
}

// WithDropResponseRate sets the probability, in [0, 1], that a response
// stream is dropped by cutting its connection before the first response
// frame reaches the client.
func WithDropResponseRate(p float64) Option {
	return func(c *config) { c.dropRate = p }
}

// WithDuplicateRate sets the probability, in [0, 1], that a request stream is
// also replayed to the server on a separate connection.
func WithDuplicateRate(p float64) Option {
	return func(c *config) { c.dupRate = p }
}

// WithDelay holds every chunk of client-to-server data for d before
// forwarding it, simulating a slow network path.
func WithDelay(d time.Duration) Option {
	return func(c *config) { c.delay = d }
}

// Stats is a snapshot of the proxy's counters.
type Stats struct {
	// Connections is the number of client connections accepted.
	Connections int64
	// Requests is the number of HTTP/2 request streams seen from clients.
	Requests int64
	// ResponsesForwarded is the number of response streams let through.
	ResponsesForwarded int64
	// ResponsesDropped is the number of response streams whose connection was
	// cut instead of delivering them.
	ResponsesDropped int64
	// RequestsDuplicated is the number of request streams replayed to the
	// server on an extra connection.
	RequestsDuplicated int64
	// ConnectionsRefused is the number of connections reset on arrival while
	// the proxy was refusing (see SetRefusing); they are not in Connections.
	ConnectionsRefused int64
	// ConnectionsCut is the number of client connections closed by CutAll.
	ConnectionsCut int64
}

// Proxy forwards loopback TCP connections to a target and injects faults.
// It is safe for concurrent use.
type Proxy struct {
	target string
	cfg    config
	ln     net.Listener
	dialer net.Dialer

	// ctx is cancelled by Close so pending dials and delays end promptly.
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu      sync.Mutex
	closed  bool
	closers map[io.Closer]struct{}

	closeOnce sync.Once
	closeErr  error

	dropMu  sync.Mutex
	dropRng *rand.Rand
	dupMu   sync.Mutex
	dupRng  *rand.Rand
	// forcedDrops counts pending DropNextResponse calls.
	forcedDrops atomic.Int64
	refusing    atomic.Bool

	connections        atomic.Int64
	requests           atomic.Int64
	responsesForwarded atomic.Int64
	responsesDropped   atomic.Int64
	requestsDuplicated atomic.Int64
	connectionsRefused atomic.Int64
	connectionsCut     atomic.Int64
}

// New starts a proxy listening on 127.0.0.1 on a random port that forwards
// every accepted connection to target.
func New(target string, opts ...Option) (*Proxy, error) {
	var cfg config
	for _, o := range opts {
		o(&cfg)
	}
	if cfg.dropRate < 0 || cfg.dropRate > 1 {
		return nil, fmt.Errorf("faultproxy: drop rate %v outside [0, 1]", cfg.dropRate)
	}
	if cfg.dupRate < 0 || cfg.dupRate > 1 {
		return nil, fmt.Errorf("faultproxy: duplicate rate %v outside [0, 1]", cfg.dupRate)
	}
	if cfg.delay < 0 {
		return nil, fmt.Errorf("faultproxy: negative delay %v", cfg.delay)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("faultproxy: listen: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	p := &Proxy{
		target:  target,
		cfg:     cfg,
		ln:      ln,
		dialer:  net.Dialer{Timeout: dialTimeout},
		ctx:     ctx,
		cancel:  cancel,
		closers: make(map[io.Closer]struct{}),
		dropRng: rand.New(rand.NewPCG(uint64(cfg.seed), pcgDropStream)),
		dupRng:  rand.New(rand.NewPCG(uint64(cfg.seed), pcgDupStream)),
	}
	p.wg.Add(1)
	go p.acceptLoop()
	return p, nil
}

// Addr returns the host:port clients should dial instead of the target.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// DropNextResponse forces the next response stream, on any connection, to be
// dropped regardless of the configured rate. Calls accumulate: n calls drop
// the next n response streams.
func (p *Proxy) DropNextResponse() { p.forcedDrops.Add(1) }

// Stats returns a snapshot of the counters.
func (p *Proxy) Stats() Stats {
	return Stats{
		Connections:        p.connections.Load(),
		Requests:           p.requests.Load(),
		ResponsesForwarded: p.responsesForwarded.Load(),
		ResponsesDropped:   p.responsesDropped.Load(),
		RequestsDuplicated: p.requestsDuplicated.Load(),
		ConnectionsRefused: p.connectionsRefused.Load(),
		ConnectionsCut:     p.connectionsCut.Load(),
	}
}

// Close stops accepting, closes every live connection (including duplicate
// replays) and waits for all of the proxy's goroutines to finish. Each one
// signals as its last act, so it may still be returning when Close does. It
// is safe to call more than once; later calls return the first call's result.
func (p *Proxy) Close() error {
	p.closeOnce.Do(func() {
		p.mu.Lock()
		p.closed = true
		closers := make([]io.Closer, 0, len(p.closers))
		for c := range p.closers {
			closers = append(closers, c)
		}
		p.mu.Unlock()

		p.cancel()
		p.closeErr = p.ln.Close()
		for _, c := range closers {
			_ = c.Close()
		}
	})
	p.wg.Wait()
	return p.closeErr
}

// track registers c to be closed by Close. It returns false, and the caller
// must close c itself, if the proxy is already closed; this closes the race
// between accepting a connection and Close snapshotting the set.
func (p *Proxy) track(c io.Closer) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return false
	}
	p.closers[c] = struct{}{}
	return true
}

func (p *Proxy) untrack(c io.Closer) {
	p.mu.Lock()
	delete(p.closers, c)
	p.mu.Unlock()
}

func (p *Proxy) acceptLoop() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			return
		}
		if p.refusing.Load() {
			p.refuse(c)
			continue
		}
		p.connections.Add(1)
		p.wg.Add(1)
		go p.handle(c)
	}
}

// decideDrop draws the drop decision for one response stream. The draw
// happens even for forced drops so DropNextResponse does not shift the
// seeded sequence.
func (p *Proxy) decideDrop() bool {
	p.dropMu.Lock()
	f := p.dropRng.Float64()
	p.dropMu.Unlock()
	for {
		n := p.forcedDrops.Load()
		if n <= 0 {
			break
		}
		if p.forcedDrops.CompareAndSwap(n, n-1) {
			return true
		}
	}
	return f < p.cfg.dropRate
}

// decideDuplicate draws the duplicate decision for one request stream.
func (p *Proxy) decideDuplicate() bool {
	p.dupMu.Lock()
	f := p.dupRng.Float64()
	p.dupMu.Unlock()
	return f < p.cfg.dupRate
}

// link is one proxied client connection and its upstream connection.
type link struct {
	client    net.Conn
	server    net.Conn
	closeOnce sync.Once
}

// Close closes both sides; closing only one would leave the other peer
// believing the connection is healthy.
func (l *link) Close() error {
	l.closeOnce.Do(func() {
		_ = l.client.Close()
		_ = l.server.Close()
	})
	return nil
}

func (p *Proxy) handle(client net.Conn) {
	defer p.wg.Done()
	if !p.track(client) {
		_ = client.Close()
		return
	}
	defer p.untrack(client)

	server, err := p.dialer.DialContext(p.ctx, "tcp", p.target)
	if err != nil {
		_ = client.Close()
		return
	}
	l := &link{client: client, server: server}
	if !p.track(l) {
		_ = l.Close()
		return
	}
	defer p.untrack(l)
	defer l.Close()

	cr := bufio.NewReaderSize(&delayReader{r: client, d: p.cfg.delay, ctx: p.ctx}, bufSize)
	// Compare byte by byte so a non-HTTP/2 client that sends fewer bytes than
	// the preface and then waits is not stalled here.
	isH2 := true
	got := make([]byte, 0, len(clientPreface))
	for len(got) < len(clientPreface) {
		b, err := cr.ReadByte()
		if err != nil {
			return
		}
		got = append(got, b)
		if b != clientPreface[len(got)-1] {
			isH2 = false
			break
		}
	}
	if _, err := server.Write(got); err != nil {
		return
	}

	p.wg.Add(1)
	if !isH2 {
		// Not HTTP/2 with prior knowledge: relay bytes without faults.
		go func() {
			defer p.wg.Done()
			defer l.Close()
			_, _ = io.Copy(client, server)
		}()
		_, _ = io.Copy(server, cr)
		return
	}
	go func() {
		defer p.wg.Done()
		defer l.Close()
		p.serverToClient(l)
	}()
	p.clientToServer(l, cr)
}

// serverToClient forwards frames to the client and applies the drop fault at
// the first HEADERS or DATA frame of each response stream.
func (p *Proxy) serverToClient(l *link) {
	r := bufio.NewReaderSize(l.server, bufSize)
	w := bufio.NewWriterSize(l.client, bufSize)
	var fr frame
	// decided holds response streams already judged; entries are removed when
	// the stream ends so the map stays as small as the number of live streams.
	decided := make(map[uint32]struct{})
	for {
		if err := fr.read(r); err != nil {
			return
		}
		if fr.isResponseStart() {
			if _, ok := decided[fr.stream]; !ok {
				decided[fr.stream] = struct{}{}
				if p.decideDrop() {
					// Deliver what came before so only this connection's
					// in-flight streams are affected, then cut both sides.
					_ = w.Flush()
					p.responsesDropped.Add(1)
					_ = l.Close()
					return
				}
				p.responsesForwarded.Add(1)
			}
		}
		if fr.endsStream() {
			delete(decided, fr.stream)
		}
		if _, err := w.Write(fr.raw); err != nil {
			return
		}
		if r.Buffered() == 0 {
			if err := w.Flush(); err != nil {
				return
			}
		}
	}
}

// clientToServer forwards frames to the server, recording what a duplicate
// replay needs and launching replays when a chosen request stream ends.
func (p *Proxy) clientToServer(l *link, r *bufio.Reader) {
	w := bufio.NewWriterSize(l.server, bufSize)
	rec := newRecorder()
	var fr frame
	var maxStream uint32
	for {
		if err := fr.read(r); err != nil {
			return
		}
		if fr.typ == frameHeaders && fr.stream > maxStream {
			// Client stream ids only grow, so a higher id is a new request.
			maxStream = fr.stream
			p.requests.Add(1)
			if p.decideDuplicate() {
				rec.choose(fr.stream)
			}
		}
		replay, stream := rec.observe(&fr)
		if _, err := w.Write(fr.raw); err != nil {
			return
		}
		if r.Buffered() == 0 {
			if err := w.Flush(); err != nil {
				return
			}
		}
		if replay != nil {
			p.wg.Add(1)
			go p.duplicate(replay, stream)
		}
	}
}

// delayReader holds each chunk it reads for d, or until ctx ends.
type delayReader struct {
	r   io.Reader
	d   time.Duration
	ctx context.Context
}

func (d *delayReader) Read(b []byte) (int, error) {
	n, err := d.r.Read(b)
	if n > 0 && d.d > 0 {
		t := time.NewTimer(d.d)
		defer t.Stop()
		select {
		case <-t.C:
		case <-d.ctx.Done():
			return 0, net.ErrClosed
		}
	}
	return n, err
}
