package faultproxy

import (
	"context"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
)

// startEcho runs a raw TCP echo server, standing in for a non-HTTP/2
// protocol such as PostgreSQL's. ended receives one value per connection
// the server saw end.
func startEcho(t *testing.T) (addr string, ended <-chan struct{}) {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	done := make(chan struct{}, 16)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := lis.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				_, _ = io.Copy(c, c)
				done <- struct{}{}
			}()
		}
	}()
	t.Cleanup(func() {
		_ = lis.Close()
		wg.Wait()
	})
	return lis.Addr().String(), done
}

// echoes reports whether a round trip over c works.
func echoes(c net.Conn) bool {
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Write([]byte("\x00ping")); err != nil {
		return false
	}
	buf := make([]byte, 5)
	_, err := io.ReadFull(c, buf)
	return err == nil && string(buf) == "\x00ping"
}

// reachable reports whether a new connection to addr echoes. A refused
// connection is accepted and reset at once, so the reset may reach the
// client while its connect is still completing (the dial fails) or after it
// (the first round trip fails); both mean refused.
func reachable(addr string) bool {
	c, err := net.Dial("tcp", addr)
	if err != nil {
		return false
	}
	defer c.Close()
	return echoes(c)
}

func TestRefusingAndCutAllRawTCP(t *testing.T) {
	addr, ended := startEcho(t)
	p := startProxy(t, addr)
	dial := func() net.Conn {
		c, err := net.Dial("tcp", p.Addr())
		require.NoError(t, err)
		t.Cleanup(func() { _ = c.Close() })
		return c
	}

	open := dial()
	require.True(t, echoes(open), "raw bytes are relayed")

	p.SetRefusing(true)
	require.False(t, reachable(p.Addr()), "a new connection is reset while refusing")
	require.True(t, echoes(open), "refusing leaves open connections alone")

	require.Equal(t, 1, p.CutAll())
	require.False(t, echoes(open), "a cut connection is dead for the client")
	select {
	case <-ended:
	case <-time.After(30 * time.Second):
		t.Fatal("the target's side of the cut connection is still open")
	}

	p.SetRefusing(false)
	require.True(t, echoes(dial()), "connections work again once refusing stops")

	st := p.Stats()
	require.EqualValues(t, 1, st.ConnectionsRefused)
	require.EqualValues(t, 1, st.ConnectionsCut)
	require.EqualValues(t, 2, st.Connections, "refused connections are not counted as accepted")
}

func TestRefusingAndCutAllGRPC(t *testing.T) {
	addr, handled, _ := startServer(t)
	p := startProxy(t, addr)
	c, _ := dialClient(t, p.Addr())
	require.NoError(t, check(c))

	p.SetRefusing(true)
	require.Equal(t, 1, p.CutAll())
	// Calls fail until the client has noticed the cut and been refused on
	// reconnecting at least once.
	deadline := time.Now().Add(5 * time.Second)
	for p.Stats().ConnectionsRefused == 0 {
		require.True(t, time.Now().Before(deadline), "the client never tried to reconnect")
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		_, err := c.Check(ctx, &healthpb.HealthCheckRequest{})
		cancel()
		require.Contains(t, []codes.Code{codes.Unavailable, codes.DeadlineExceeded}, status.Code(err),
			"no call gets through while the proxy refuses: %v", err)
	}
	require.EqualValues(t, 1, handled.Load())

	p.SetRefusing(false)
	outcomes := callWithRetry(t, c)
	require.True(t, outcomes[len(outcomes)-1], "calls succeed again once refusing stops")
	require.EqualValues(t, 2, handled.Load())
}
