package faultproxy

import (
	"context"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
)

// startServer runs a real gRPC server with the standard health service. The
// returned counter counts handler executions, which is what proves whether a
// request reached and was processed by the server.
func startServer(t *testing.T) (string, *atomic.Int64, func()) {
	t.Helper()
	var handled atomic.Int64
	srv := grpc.NewServer(grpc.UnaryInterceptor(
		func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
			handled.Add(1)
			return h(ctx, req)
		}))
	healthpb.RegisterHealthServer(srv, health.NewServer())
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(lis)
	}()
	var once sync.Once
	stop := func() {
		once.Do(func() {
			srv.Stop()
			<-done
		})
	}
	t.Cleanup(stop)
	return lis.Addr().String(), &handled, stop
}

func startProxy(t *testing.T, target string, opts ...Option) *Proxy {
	t.Helper()
	p, err := New(target, opts...)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, p.Close()) })
	return p
}

func dialClient(t *testing.T, addr string) (healthpb.HealthClient, *grpc.ClientConn) {
	t.Helper()
	cc, err := grpc.NewClient("passthrough:///"+addr,
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { _ = cc.Close() })
	return healthpb.NewHealthClient(cc), cc
}

func check(c healthpb.HealthClient) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	// WaitForReady makes an attempt wait for the reconnect after a drop
	// instead of failing fast, so every failed attempt is a real drop.
	_, err := c.Check(ctx, &healthpb.HealthCheckRequest{}, grpc.WaitForReady(true))
	return err
}

// callWithRetry retries Unavailable errors, as a client of an idempotent API
// would, and returns the outcome of every attempt (true = success).
func callWithRetry(t *testing.T, c healthpb.HealthClient) []bool {
	t.Helper()
	var outcomes []bool
	for range 50 {
		err := check(c)
		if err == nil {
			return append(outcomes, true)
		}
		require.Equal(t, codes.Unavailable, status.Code(err), "unexpected error: %v", err)
		outcomes = append(outcomes, false)
	}
	t.Fatalf("call did not succeed after %d attempts", len(outcomes))
	return nil
}

func TestNoFaults(t *testing.T) {
	addr, handled, _ := startServer(t)
	p := startProxy(t, addr)
	c, _ := dialClient(t, p.Addr())

	for i := range 100 {
		require.NoError(t, check(c), "call %d", i)
	}
	require.Equal(t, int64(100), handled.Load())
	st := p.Stats()
	require.Equal(t, int64(100), st.ResponsesForwarded)
	require.Equal(t, int64(100), st.Requests)
	require.Zero(t, st.ResponsesDropped)
	require.Zero(t, st.RequestsDuplicated)
	require.Equal(t, int64(1), st.Connections)
}

func TestDropNextResponse(t *testing.T) {
	addr, handled, _ := startServer(t)
	p := startProxy(t, addr)
	c, _ := dialClient(t, p.Addr())

	require.NoError(t, check(c))
	require.Equal(t, int64(1), handled.Load())

	p.DropNextResponse()
	err := check(c)
	require.Equal(t, codes.Unavailable, status.Code(err), "got %v", err)
	// The handler ran although the client saw a failure: the response was
	// lost after the server processed the request.
	require.Equal(t, int64(2), handled.Load())
	require.Equal(t, int64(1), p.Stats().ResponsesDropped)

	// The client reconnects and the following call goes through.
	require.Equal(t, []bool{true}, callWithRetry(t, c))
	require.Equal(t, int64(3), handled.Load())
	require.Equal(t, int64(2), p.Stats().Connections)
}

// runDropRate makes sequential calls through a proxy with a seeded drop rate
// and returns every attempt's outcome.
func runDropRate(t *testing.T, seed int64, rate float64, calls int) []bool {
	addr, handled, _ := startServer(t)
	p := startProxy(t, addr, WithSeed(seed), WithDropResponseRate(rate))
	c, _ := dialClient(t, p.Addr())

	var outcomes []bool
	for range calls {
		outcomes = append(outcomes, callWithRetry(t, c)...)
	}
	st := p.Stats()
	require.Equal(t, int64(len(outcomes)), handled.Load(), "every attempt must reach the handler")
	require.Greater(t, handled.Load(), int64(calls), "some responses must have been dropped")
	require.Equal(t, int64(calls), st.ResponsesForwarded)
	require.Equal(t, int64(len(outcomes)-calls), st.ResponsesDropped)
	require.Equal(t, st.ResponsesDropped+1, st.Connections)
	return outcomes
}

func TestDropRateDeterministic(t *testing.T) {
	const seed, rate, calls = 42, 0.3, 200
	first := runDropRate(t, seed, rate, calls)
	second := runDropRate(t, seed, rate, calls)
	require.Equal(t, first, second, "same seed must give the same drop decisions")

	// The decisions are exactly the documented PCG draws, one per response.
	rng := rand.New(rand.NewPCG(uint64(seed), pcgDropStream))
	for i, ok := range first {
		require.Equal(t, rng.Float64() >= rate, ok, "attempt %d", i)
	}

	other := runDropRate(t, seed+1, rate, calls)
	require.NotEqual(t, first, other, "a different seed should give other decisions")
}

// cutByDrop reports whether err is how gRPC fails a call in flight on a
// connection the proxy cut: Unavailable, or a bare io.EOF when the cut landed
// after the call opened its stream but before it wrote the request
// (grpc-go issue 7230).
func cutByDrop(err error) bool {
	return status.Code(err) == codes.Unavailable || errors.Is(err, io.EOF)
}

func TestDropRateConcurrent(t *testing.T) {
	addr, handled, _ := startServer(t)
	p := startProxy(t, addr, WithSeed(7), WithDropResponseRate(0.2))
	c, _ := dialClient(t, p.Addr())

	const workers, perWorker = 8, 25
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for range perWorker {
				var err error
				for range 50 {
					if err = check(c); !cutByDrop(err) {
						break
					}
				}
				if err != nil {
					t.Errorf("call failed: %v", err)
					return
				}
			}
		})
	}
	wg.Wait()
	st := p.Stats()
	// A drop cuts the whole connection, so a response already partly
	// forwarded can still be lost, and other calls in flight may fail before
	// or after the server handled them. Hence only lower bounds.
	require.GreaterOrEqual(t, st.ResponsesForwarded, int64(workers*perWorker))
	require.Positive(t, st.ResponsesDropped)
	require.GreaterOrEqual(t, handled.Load(), st.ResponsesForwarded+st.ResponsesDropped)
}

func TestDuplicate(t *testing.T) {
	addr, handled, _ := startServer(t)
	p := startProxy(t, addr, WithDuplicateRate(1.0))
	c, _ := dialClient(t, p.Addr())

	const calls = 20
	for i := range calls {
		require.NoError(t, check(c), "call %d", i)
	}
	require.Eventually(t, func() bool {
		return handled.Load() == 2*calls && p.Stats().RequestsDuplicated == calls
	}, 5*time.Second, 5*time.Millisecond, "handled=%d stats=%+v", handled.Load(), p.Stats())
	// Replays neutralize earlier streams, so nothing runs a third time.
	time.Sleep(50 * time.Millisecond)
	require.Equal(t, int64(2*calls), handled.Load())
	st := p.Stats()
	require.Equal(t, int64(calls), st.ResponsesForwarded)
	require.Equal(t, int64(1), st.Connections, "replays must not be counted as client connections")
}

func TestDuplicateRateSeeded(t *testing.T) {
	addr, handled, _ := startServer(t)
	const seed, rate, calls = 3, 0.5, 40
	p := startProxy(t, addr, WithSeed(seed), WithDuplicateRate(rate))
	c, _ := dialClient(t, p.Addr())

	for i := range calls {
		require.NoError(t, check(c), "call %d", i)
	}
	rng := rand.New(rand.NewPCG(uint64(seed), pcgDupStream))
	var want int64
	for range calls {
		if rng.Float64() < rate {
			want++
		}
	}
	require.Eventually(t, func() bool {
		return handled.Load() == calls+want && p.Stats().RequestsDuplicated == want
	}, 5*time.Second, 5*time.Millisecond, "handled=%d want dups=%d", handled.Load(), want)
}

func TestDelay(t *testing.T) {
	addr, _, _ := startServer(t)
	const delay = 40 * time.Millisecond
	p := startProxy(t, addr, WithDelay(delay))
	c, _ := dialClient(t, p.Addr())

	require.NoError(t, check(c)) // connection setup
	start := time.Now()
	require.NoError(t, check(c))
	require.GreaterOrEqual(t, time.Since(start), delay)
}

func TestRawPassthrough(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = lis.Close() })
	go func() {
		conn, err := lis.Accept()
		if err != nil {
			return
		}
		defer conn.Close()
		_, _ = io.Copy(conn, conn)
	}()
	p := startProxy(t, lis.Addr().String())

	conn, err := net.Dial("tcp", p.Addr())
	require.NoError(t, err)
	defer conn.Close()
	require.NoError(t, conn.SetDeadline(time.Now().Add(5*time.Second)))
	_, err = conn.Write([]byte("PRX ping"))
	require.NoError(t, err)
	buf := make([]byte, 8)
	_, err = io.ReadFull(conn, buf)
	require.NoError(t, err)
	require.Equal(t, "PRX ping", string(buf))
}

func TestOptionValidation(t *testing.T) {
	for _, opt := range []Option{
		WithDropResponseRate(-0.1), WithDropResponseRate(1.1),
		WithDuplicateRate(2), WithDelay(-time.Second),
	} {
		_, err := New("127.0.0.1:1", opt)
		require.Error(t, err)
	}
}

func TestCloseNoLeaks(t *testing.T) {
	before := runtime.NumGoroutine()

	addr, _, stopServer := startServer(t)
	p, err := New(addr, WithDuplicateRate(0.5), WithDropResponseRate(0.2))
	require.NoError(t, err)
	// Close is idempotent; this only stops a failed run from leaking into
	// the next test.
	t.Cleanup(func() { _ = p.Close() })
	cc, err := grpc.NewClient("passthrough:///"+p.Addr(),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { _ = cc.Close() })
	c := healthpb.NewHealthClient(cc)
	for range 10 {
		callWithRetry(t, c)
	}

	// A raw connection that is still open when the proxy closes must be cut.
	raw, err := net.Dial("tcp", p.Addr())
	require.NoError(t, err)
	defer raw.Close()
	_, err = raw.Write([]byte(clientPreface))
	require.NoError(t, err)

	done := make(chan error, 1)
	go func() { done <- p.Close() }()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(30 * time.Second):
		t.Fatal("Close did not return")
	}
	require.NoError(t, p.Close(), "Close must be idempotent")
	// Close returns once every proxy goroutine has signalled, as its last
	// act, that it is done, so one may still be returning at this instant;
	// poll by hand. The client and server are still open, so only Close can
	// have ended them.
	buf := make([]byte, 1<<20)
	stacks := func() string { return string(buf[:runtime.Stack(buf, true)]) }
	deadline := time.Now().Add(5 * time.Second)
	for strings.Contains(stacks(), "faultproxy.(*Proxy).") && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	require.NotContains(t, stacks(), "faultproxy.(*Proxy).")

	require.NoError(t, raw.SetReadDeadline(time.Now().Add(5*time.Second)))
	_, err = io.ReadAll(raw)
	var ne net.Error
	require.False(t, errors.As(err, &ne) && ne.Timeout(), "connection still open after Close")

	_, err = net.DialTimeout("tcp", p.Addr(), time.Second)
	require.Error(t, err, "listener still open after Close")

	require.NoError(t, cc.Close())
	stopServer()
	// Poll by hand: require.Eventually runs its condition on an extra
	// goroutine, which would itself be counted.
	deadline = time.Now().Add(5 * time.Second)
	for runtime.NumGoroutine() > before && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if n := runtime.NumGoroutine(); n > before {
		t.Fatalf("goroutines: before=%d after=%d\n%s", before, n, buf[:runtime.Stack(buf, true)])
	}
}
