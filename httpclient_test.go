package idempotency_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/faultproxy"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// HTTPClient, 16 logical POSTs at a time inside one call each, against a
// provider whose front end fails at random: resets before the provider
// sees the request, resets after it committed, 500 before, 409 and 429
// with Retry-After garbage, negative or huge-but-past-the-deadline. Every
// request executes once, every attempt of one request carries its key.
func TestHTTPClientThroughAFlakyFrontEnd(t *testing.T) {
	t.Parallel()
	p := startProvider(t) // HTTPMiddleware on a ledger
	target, err := url.Parse(p.url)
	require.NoError(t, err)
	var faults sync.Map
	var mu sync.Mutex
	rng := rand.New(rand.NewPCG(1, 2))
	front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		mu.Lock()
		f := rng.IntN(8)
		mu.Unlock()
		faults.Store(f, true)
		forward := func() (*http.Response, error) {
			req, _ := http.NewRequestWithContext(r.Context(), r.Method, target.String()+r.URL.Path, bytes.NewReader(body))
			req.Header = r.Header.Clone()
			return http.DefaultTransport.RoundTrip(req)
		}
		hijack := func() {
			if c, _, err := w.(http.Hijacker).Hijack(); err == nil {
				_ = c.Close()
			}
		}
		switch f {
		case 0:
			hijack()
		case 1:
			if resp, err := forward(); err == nil {
				_ = resp.Body.Close()
			}
			hijack() // committed, answer lost
		case 2:
			http.Error(w, "upstream down", http.StatusInternalServerError)
		case 3:
			w.Header().Set("Retry-After", "soon")
			w.WriteHeader(http.StatusConflict)
		case 4:
			w.Header().Set("Retry-After", "-3")
			w.WriteHeader(http.StatusTooManyRequests)
		default:
			resp, err := forward()
			if err != nil {
				http.Error(w, err.Error(), http.StatusBadGateway)
				return
			}
			defer resp.Body.Close()
			for k, v := range resp.Header {
				w.Header()[k] = v
			}
			w.WriteHeader(resp.StatusCode)
			_, _ = io.Copy(w, resp.Body)
		}
	}))
	t.Cleanup(front.Close)
	tr := http.DefaultTransport.(*http.Transport).Clone()
	t.Cleanup(tr.CloseIdleConnections)
	log := &attempts{base: tr}
	hc := &idempotency.HTTPClient{Client: &http.Client{Transport: log, Timeout: 10 * time.Second}, MaxAttempts: 40, Budget: liveness, BackoffBase: time.Millisecond, BackoffMax: 5 * time.Millisecond}
	store := migratedStore(t, testdb.New(t, 20))

	const n = 64
	var wg sync.WaitGroup
	keys := make([]string, n)
	errs := make([]error, n)
	sem := make(chan struct{}, 16)
	for i := range n {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			_, errs[i] = store.Execute(context.Background(), idempotency.Call{Key: fmt.Sprintf("order-%d", i), Method: "m"}, func(ctx context.Context, _ pgx.Tx) (proto.Message, error) {
				resp, err := hc.Do(newPost(t, idempotency.WithEffect(ctx, "charge"), front.URL+"/v1/charges", fmt.Sprintf("charge %d", i)))
				if err != nil {
					return nil, err
				}
				keys[i] = sentKey(resp)
				if got := readAll(resp); resp.StatusCode != http.StatusOK || got != fmt.Sprintf("charge %d", i) {
					return nil, fmt.Errorf("%d: %s %q", i, resp.Status, got)
				}
				return nil, nil
			})
		})
	}
	wg.Wait()
	require.NoError(t, errors.Join(errs...))
	require.EqualValues(t, n, p.execs.Load(), "each logical request executed once")
	byKey := map[string]int{}
	for _, k := range keys {
		byKey[k]++
	}
	require.Len(t, byKey, n)
	log.mu.Lock()
	defer log.mu.Unlock()
	for _, k := range log.keys {
		require.Contains(t, byKey, k, "every attempt carried its request's key")
	}
	require.Greater(t, len(log.keys), n, "faults were injected")
}

// Do's edges: a 409 forever ends within MaxAttempts; a Retry-After far
// past the budget returns the response at once; GetBody failing stops
// with the key; NoBody and a nil Header are retried; a Client.Timeout
// cuts and retries an attempt under the key; a refused redirect is not
// retried; a 303 turns the POST into a GET carrying the key; a context
// cancelled mid-wait returns at once with the key; the caller's request
// is never modified.
func TestHTTPClientEdges(t *testing.T) {
	t.Parallel()
	var hits atomic.Int64
	var arrivals keyLog
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		arrivals.add(r.URL.Path + " " + r.Method + " " + r.Header.Get(idempotency.HeaderKey))
		switch r.URL.Path {
		case "/conflict":
			w.WriteHeader(http.StatusConflict)
		case "/huge":
			w.Header().Set("Retry-After", "99999999999999999999")
			w.WriteHeader(http.StatusServiceUnavailable)
		case "/flaky":
			if hits.Add(1)%2 == 1 {
				w.WriteHeader(http.StatusBadGateway)
				return
			}
			_, _ = io.WriteString(w, "ok")
		case "/slow":
			if hits.Add(1)%2 == 1 {
				select {
				case <-time.After(2 * time.Second):
				case <-r.Context().Done():
				}
				return
			}
			_, _ = io.WriteString(w, "ok")
		case "/see-other":
			http.Redirect(w, r, "/landing", http.StatusSeeOther)
		case "/landing":
			_, _ = io.WriteString(w, "landed")
		case "/wait":
			w.Header().Set("Retry-After", "30")
			w.WriteHeader(http.StatusServiceUnavailable)
		}
	}))
	t.Cleanup(srv.Close)
	hc := &idempotency.HTTPClient{MaxAttempts: 4, Budget: 5 * time.Second, BackoffBase: time.Millisecond, BackoffMax: 2 * time.Millisecond}
	post := func(ctx context.Context, path string, body io.Reader) *http.Request {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+path, body)
		require.NoError(t, err)
		return req
	}

	t.Run("409 forever", func(t *testing.T) {
		start := time.Now()
		resp, err := hc.Do(post(context.Background(), "/conflict", strings.NewReader("x")))
		require.NoError(t, err)
		_ = resp.Body.Close()
		require.Equal(t, http.StatusConflict, resp.StatusCode)
		require.Less(t, time.Since(start), 2*time.Second)
	})
	t.Run("huge Retry-After", func(t *testing.T) {
		start := time.Now()
		resp, err := hc.Do(post(context.Background(), "/huge", strings.NewReader("x")))
		require.NoError(t, err)
		_ = resp.Body.Close()
		require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
		require.Less(t, time.Since(start), time.Second)
	})
	t.Run("GetBody fails", func(t *testing.T) {
		req := post(context.Background(), "/flaky", strings.NewReader("x"))
		req.GetBody = func() (io.ReadCloser, error) { return nil, errors.New("gone") }
		hits.Store(0)
		_, err := hc.Do(req)
		re := requireRetryError(t, err, 1)
		require.NotEmpty(t, re.Key)
	})
	t.Run("NoBody and a nil Header", func(t *testing.T) {
		req := post(context.Background(), "/flaky", http.NoBody)
		req.Header = nil
		hits.Store(0)
		resp, err := hc.Do(req)
		require.NoError(t, err)
		require.Equal(t, "ok", readAll(resp))
		require.Nil(t, req.Header, "the caller's request is not modified")
		h := arrivals.all()
		require.Equal(t, h[len(h)-2], h[len(h)-1], "one key for both attempts")
	})
	t.Run("Client.Timeout", func(t *testing.T) {
		hc := *hc
		hc.Client = &http.Client{Timeout: 200 * time.Millisecond}
		hits.Store(0)
		req := post(context.Background(), "/slow", strings.NewReader("x"))
		resp, err := hc.Do(req)
		require.NoError(t, err)
		require.Equal(t, "ok", readAll(resp))
		require.Empty(t, req.Header.Get(idempotency.HeaderKey), "the caller's request is not modified")
		h := arrivals.all()
		require.Equal(t, h[len(h)-2], h[len(h)-1])
	})
	t.Run("CheckRedirect refuses", func(t *testing.T) {
		hc := *hc
		hc.Client = &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return errors.New("no redirects") }}
		before := len(arrivals.all())
		_, err := hc.Do(post(context.Background(), "/see-other", strings.NewReader("x")))
		re := requireRetryError(t, err, 1)
		require.NotEmpty(t, re.Key)
		require.Len(t, arrivals.all(), before+1)
	})
	t.Run("303", func(t *testing.T) {
		resp, err := hc.Do(post(context.Background(), "/see-other", strings.NewReader("x")))
		require.NoError(t, err)
		require.Equal(t, "landed", readAll(resp))
		require.Equal(t, http.MethodGet, resp.Request.Method)
		require.NotEmpty(t, sentKey(resp), "the key is readable on the last hop")
		h := arrivals.all()
		require.Equal(t, "/landing GET "+sentKey(resp), h[len(h)-1])
	})
	t.Run("cancelled mid-wait", func(t *testing.T) {
		hc := *hc
		hc.Budget = time.Minute
		ctx, cancel := context.WithCancel(context.Background())
		time.AfterFunc(100*time.Millisecond, cancel)
		start := time.Now()
		_, err := hc.Do(post(ctx, "/wait", strings.NewReader("x")))
		re := requireRetryError(t, err, 1)
		require.NotEmpty(t, re.Key)
		require.ErrorIs(t, err, context.Canceled)
		require.Less(t, time.Since(start), 2*time.Second)
	})
}

// What the HTTPClient tests share: a provider that honours Idempotency-Key
// with HTTPMiddleware over HTTP/2 without TLS (so that the fault proxy sees
// where each response starts), clients that speak it, and a proxy in front
// that drops responses after the provider committed.

// h2cServer serves h over HTTP/1 and unencrypted HTTP/2 until t ends;
// maxStreams > 0 bounds the streams of one connection, so that a client
// with more requests in flight opens more connections.
func h2cServer(t *testing.T, h http.Handler, maxStreams uint32) *httptest.Server {
	t.Helper()
	srv := httptest.NewUnstartedServer(h)
	srv.Config.Protocols = new(http.Protocols)
	srv.Config.Protocols.SetHTTP1(true)
	srv.Config.Protocols.SetUnencryptedHTTP2(true)
	if maxStreams > 0 {
		srv.Config.HTTP2 = &http.HTTP2Config{MaxConcurrentStreams: int(maxStreams)}
	}
	srv.Start()
	t.Cleanup(srv.Close)
	return srv
}

// h2cTransport speaks HTTP/2 without TLS (prior knowledge).
func h2cTransport(t *testing.T) *http.Transport {
	t.Helper()
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.Protocols = new(http.Protocols)
	tr.Protocols.SetUnencryptedHTTP2(true)
	t.Cleanup(tr.CloseIdleConnections)
	return tr
}

// startH2CProvider is startProvider over h2c: a ledger insert behind
// HTTPMiddleware that echoes the body, each arrival's key logged. It
// returns the provider's address for a proxy to stand in front of.
func startH2CProvider(t *testing.T, maxStreams uint32, opts ...idempotency.StoreOption) (*provider, *testdb.DB, string) {
	t.Helper()
	db := testdb.New(t, 8)
	store := migratedStore(t, db, opts...)
	createLedger(t, db)
	p := &provider{}
	protected := idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		if _, err := idempotency.MustTxFromContext(r.Context()).Exec(r.Context(), `INSERT INTO ledger (note) VALUES ($1)`, string(body)); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		p.execs.Add(1)
		_, _ = w.Write(body)
	}))
	srv := h2cServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p.headers.add(r.Method + " " + r.Header.Get(idempotency.HeaderKey))
		protected.ServeHTTP(w, r)
	}), maxStreams)
	p.url = srv.URL
	return p, db, srv.Listener.Addr().String()
}

// droppingProxy stands in front of addr, dropping rate of the responses
// (and those DropNextResponse asks for).
func droppingProxy(t *testing.T, addr string, rate float64, seed int64) (*faultproxy.Proxy, string) {
	t.Helper()
	p, err := faultproxy.New(addr, faultproxy.WithSeed(seed), faultproxy.WithDropResponseRate(rate))
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	return p, "http://" + p.Addr()
}

// fastRetries is an HTTPClient through c whose waits are short.
func fastRetries(c *http.Client) *idempotency.HTTPClient {
	return &idempotency.HTTPClient{Client: c, MaxAttempts: 20, Budget: liveness, BackoffBase: time.Millisecond, BackoffMax: 10 * time.Millisecond}
}

// newPost is a POST of body to url made with ctx.
func newPost(t *testing.T, ctx context.Context, url, body string) *http.Request {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	require.NoError(t, err)
	return req
}

// readAll reads and closes resp's body.
func readAll(resp *http.Response) string {
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

// sentKey is the key resp's request carried.
func sentKey(resp *http.Response) string { return resp.Request.Header.Get(idempotency.HeaderKey) }

// keysOf are the keys a provider received, in order, without the method.
func keysOf(p *provider) []string {
	var keys []string
	for _, h := range p.headers.all() {
		_, k, _ := strings.Cut(h, " ")
		keys = append(keys, k)
	}
	return keys
}

// effectKeys are the keys EffectKey gives names in a run of call; the run
// releases the key.
func effectKeys(t *testing.T, store *idempotency.Store, call idempotency.Call, names ...string) []string {
	t.Helper()
	var keys []string
	_, err := store.Execute(context.Background(), call, func(ctx context.Context, _ pgx.Tx) (proto.Message, error) {
		for _, name := range names {
			k, ok := idempotency.EffectKey(ctx, name)
			require.True(t, ok)
			keys = append(keys, k)
		}
		return nil, status.Error(codes.Unavailable, "release the key: this run only reads the keys")
	})
	require.Equal(t, codes.Unavailable, status.Code(err))
	return keys
}

// The flagship: 500 logical POST requests, 16 at a time, from an HTTPClient
// outside any call, to a provider behind HTTPMiddleware, through a network
// that drops 20% of the responses after the provider committed. Every
// request succeeds, with one key for all of its attempts, and the provider
// executed each one once.
func TestHTTPClientDroppedResponsesExecuteEachRequestOnce(t *testing.T) {
	t.Parallel()
	// One stream per connection: a drop cuts the connection of the
	// response it drops, and so fails only that request's attempt.
	p, db, addr := startH2CProvider(t, 1)
	proxy, url := droppingProxy(t, addr, 0.2, 20)
	hc := fastRetries(&http.Client{Transport: h2cTransport(t)})

	const n, workers = 500, 16
	keys := make([]string, n)
	errs := make([]error, n)
	var next atomic.Int64
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for i := int(next.Add(1) - 1); i < n; i = int(next.Add(1) - 1) {
				body := fmt.Sprintf("charge %d", i)
				req, err := http.NewRequest(http.MethodPost, url+"/v1/charges", strings.NewReader(body))
				if err == nil {
					var resp *http.Response
					if resp, err = hc.Do(req); err == nil {
						keys[i] = sentKey(resp)
						if got := readAll(resp); resp.StatusCode != http.StatusOK || got != body {
							err = fmt.Errorf("%s: %s %q", body, resp.Status, got)
						}
					}
				}
				errs[i] = err
			}
		})
	}
	wg.Wait()
	require.NoError(t, errors.Join(errs...), "every logical request succeeded")

	distinct := map[string]bool{}
	for _, k := range keys {
		u, err := uuid.Parse(k)
		require.NoError(t, err, "outside a call the key is a new UUID: %q", k)
		require.EqualValues(t, 7, u.Version())
		distinct[k] = true
	}
	require.Len(t, distinct, n, "each logical request had a key of its own")
	arrivals := keysOf(p)
	seen := map[string]bool{}
	for _, k := range arrivals {
		require.True(t, distinct[k], "every attempt carried its request's key, never another: %q", k)
		seen[k] = true
	}
	require.Len(t, seen, n)
	dropped := proxy.Stats().ResponsesDropped
	require.Positive(t, dropped, "the network dropped responses")
	require.Greater(t, len(arrivals), n, "dropped responses were retried")
	require.EqualValues(t, n, p.execs.Load(), "the provider executed each request once")
	require.Equal(t, n, db.Count(t, `SELECT count(*) FROM ledger`))
	require.Equal(t, n, db.Count(t, `SELECT count(DISTINCT note) FROM ledger`))
	t.Logf("%d requests, %d attempts reached the provider, %d responses dropped, %d executions", n, len(arrivals), dropped, p.execs.Load())
}

// Inside a running call, HTTPClient derives the key of the effect the
// request's context names, through a network that drops the first
// response of each run. The call fails after
// the provider answered, releasing its key; its re-run sends the provider
// the same key, which executes once.
func TestHTTPClientRerunOfACallSendsTheSameKey(t *testing.T) {
	t.Parallel()
	p, _, addr := startH2CProvider(t, 0)
	proxy, url := droppingProxy(t, addr, 0, 21)
	hc := fastRetries(&http.Client{Transport: h2cTransport(t)})
	store := migratedStore(t, testdb.New(t, 2))
	call := idempotency.Call{Scope: "shop", Key: "order-11", Method: "Checkout"}

	var sent []string
	run := func() error {
		_, err := store.Execute(context.Background(), call, func(ctx context.Context, _ pgx.Tx) (proto.Message, error) {
			proxy.DropNextResponse()
			resp, err := hc.Do(newPost(t, idempotency.WithEffect(ctx, "charge 11"), url+"/v1/charges", "charge 11"))
			if err != nil {
				return nil, status.Errorf(codes.Unavailable, "provider: %v", err)
			}
			sent = append(sent, sentKey(resp))
			if body := readAll(resp); resp.StatusCode != http.StatusOK || body != "charge 11" {
				return nil, status.Errorf(codes.Internal, "provider: %s %q", resp.Status, body)
			}
			return nil, status.Error(codes.Unavailable, "fail after the provider answered, releasing the key")
		})
		return err
	}
	require.Equal(t, codes.Unavailable, status.Code(run()))
	require.Equal(t, codes.Unavailable, status.Code(run()))

	want := effectKeys(t, store, call, "charge 11")[0]
	requireDerived(t, []string{want}, "order-11", "shop")
	require.Equal(t, []string{want, want}, sent, "both runs sent the key of the effect")
	require.Equal(t, []string{want, want, want, want}, keysOf(p), "each run: the attempt whose response was dropped, and its retry")
	require.EqualValues(t, 2, proxy.Stats().ResponsesDropped)
	require.EqualValues(t, 1, p.execs.Load(), "the provider executed the charge once")
}

// A handler that retries its own call, naming the effect, sends the same
// key each time: one execution, then the stored answer.
func TestHTTPClientHandlerRetryingItsCallWithANamedEffect(t *testing.T) {
	t.Parallel()
	p := startProvider(t)
	store := migratedStore(t, testdb.New(t, 2))
	hc := fastRetries(nil)

	var sent, replayed []string
	var effect string
	_, err := store.Execute(context.Background(), idempotency.Call{Key: "order-12", Method: "Checkout"}, func(ctx context.Context, _ pgx.Tx) (proto.Message, error) {
		effect, _ = idempotency.EffectKey(ctx, "charge x")
		for range 2 {
			resp, err := hc.Do(newPost(t, idempotency.WithEffect(ctx, "charge x"), p.url+"/v1/charges", "charge x"))
			if err != nil {
				return nil, err
			}
			_ = readAll(resp)
			sent = append(sent, sentKey(resp))
			replayed = append(replayed, resp.Header.Get(idempotency.ReplayedHeader))
		}
		return nil, nil
	})
	require.NoError(t, err)
	requireDerived(t, []string{effect}, "order-12")
	require.Equal(t, []string{effect, effect}, sent)
	require.Equal(t, []string{"POST " + effect, "POST " + effect}, p.headers.all())
	require.Equal(t, []string{"", "true"}, replayed, "the second call got the stored answer")
	require.EqualValues(t, 1, p.execs.Load())
}

// attempts records the key of every attempt a Client sends, and its error.
type attempts struct {
	base http.RoundTripper
	mu   sync.Mutex
	keys []string
	errs []error
}

func (a *attempts) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := a.base.RoundTrip(r)
	a.mu.Lock()
	defer a.mu.Unlock()
	a.keys = append(a.keys, r.Header.Get(idempotency.HeaderKey))
	a.errs = append(a.errs, err)
	return resp, err
}

// closedAddr is a loopback address where nothing listens.
func closedAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := l.Addr().String()
	require.NoError(t, l.Close())
	return addr
}

// The first attempt finds the provider's port closed (connection refused),
// the second reaches it: both carry the key of the effect the request
// names, and the call's next request its own effect's key.
func TestHTTPClientRetryAfterConnectionRefusedKeepsTheKey(t *testing.T) {
	t.Parallel()
	p := startProvider(t)
	store := migratedStore(t, testdb.New(t, 2))
	refused := closedAddr(t)
	tr := http.DefaultTransport.(*http.Transport).Clone()
	t.Cleanup(tr.CloseIdleConnections)
	var dials atomic.Int64
	var d net.Dialer
	tr.DialContext = func(ctx context.Context, network, addr string) (net.Conn, error) {
		if dials.Add(1) == 1 {
			addr = refused
		}
		return d.DialContext(ctx, network, addr)
	}
	log := &attempts{base: tr}
	hc := fastRetries(&http.Client{Transport: log})
	call := idempotency.Call{Key: "order-13", Method: "Checkout"}

	var sent []string
	_, err := store.Execute(context.Background(), call, func(ctx context.Context, _ pgx.Tx) (proto.Message, error) {
		for _, body := range []string{"charge 1", "charge 2"} {
			resp, err := hc.Do(newPost(t, idempotency.WithEffect(ctx, body), p.url+"/v1/charges", body))
			if err != nil {
				return nil, err
			}
			_ = readAll(resp)
			sent = append(sent, sentKey(resp))
		}
		return nil, status.Error(codes.Unavailable, "release the key, so that a re-run can read the keys")
	})
	require.Equal(t, codes.Unavailable, status.Code(err))
	require.Len(t, log.errs, 3)
	require.ErrorIs(t, log.errs[0], syscall.ECONNREFUSED, "the first attempt found the port closed")
	require.NoError(t, log.errs[1])
	require.NoError(t, log.errs[2])
	require.Equal(t, []string{sent[0], sent[0], sent[1]}, log.keys, "the refused attempt and its retry carried one key")
	require.Equal(t, effectKeys(t, store, call, "charge 1", "charge 2"), sent,
		"the two requests got their effects' keys")
	require.Equal(t, []string{"POST " + sent[0], "POST " + sent[1]}, p.headers.all())
	require.EqualValues(t, 2, p.execs.Load())
}

// recordWaits makes hc record each wait between its attempts; sleep says
// whether it also waits them out.
func recordWaits(hc *idempotency.HTTPClient, sleep bool) func() []time.Duration {
	var mu sync.Mutex
	var waits []time.Duration
	idempotency.SetHTTPClientWait(hc, func(ctx context.Context, d time.Duration) error {
		mu.Lock()
		waits = append(waits, d)
		mu.Unlock()
		if !sleep {
			return nil
		}
		return idempotency.SleepContext(ctx, d)
	})
	return func() []time.Duration {
		mu.Lock()
		defer mu.Unlock()
		return append([]time.Duration(nil), waits...)
	}
}

// A server that answers 503 or 429 with Retry-After, then 200, gets two
// attempts under one key, and the wait between them is at least the one
// it asked for; a Retry-After past the budget is not waited for: its
// response is returned.
func TestHTTPClientHonoursRetryAfter(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name       string
		status     int
		retryAfter func() string
		sleep      bool
	}{
		{"503 in seconds", http.StatusServiceUnavailable, func() string { return "1" }, true},
		// An HTTP date has whole seconds: 5 s ahead is at least 4 s ahead
		// when the client reads it. The test records that wait without
		// sleeping it.
		{"429 as a date", http.StatusTooManyRequests, func() string { return time.Now().Add(5 * time.Second).UTC().Format(http.TimeFormat) }, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var arrivals keyLog
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				body, _ := io.ReadAll(r.Body)
				arrivals.add(r.Header.Get(idempotency.HeaderKey) + " " + string(body))
				if len(arrivals.all()) == 1 {
					w.Header().Set("Retry-After", tc.retryAfter())
					w.WriteHeader(tc.status)
					return
				}
				_, _ = io.WriteString(w, "done")
			}))
			t.Cleanup(srv.Close)
			hc := fastRetries(srv.Client())
			waits := recordWaits(hc, tc.sleep)

			resp, err := hc.Do(newPost(t, context.Background(), srv.URL+"/v1/jobs", "job 1"))
			require.NoError(t, err)
			require.Equal(t, http.StatusOK, resp.StatusCode)
			require.Equal(t, "done", readAll(resp))
			key := sentKey(resp)
			require.Equal(t, []string{key + " job 1", key + " job 1"}, arrivals.all(), "two attempts, one key, the whole body each time")
			require.Len(t, waits(), 1)
			require.GreaterOrEqual(t, waits()[0], time.Second, "the wait was at least the Retry-After")
		})
	}

	t.Run("past the budget", func(t *testing.T) {
		t.Parallel()
		var arrivals atomic.Int64
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			arrivals.Add(1)
			w.Header().Set("Retry-After", "3600")
			http.Error(w, "come back in an hour", http.StatusServiceUnavailable)
		}))
		t.Cleanup(srv.Close)
		hc := fastRetries(srv.Client())
		waits := recordWaits(hc, false)
		resp, err := hc.Do(newPost(t, context.Background(), srv.URL+"/v1/jobs", "job 2"))
		require.NoError(t, err, "a status is not an error")
		require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
		require.Equal(t, "come back in an hour\n", readAll(resp), "the response is returned whole")
		require.NotEmpty(t, sentKey(resp))
		require.EqualValues(t, 1, arrivals.Load())
		require.Empty(t, waits(), "an hour is past the budget: no wait")
	})
}

// statusWriter records the status a handler answered.
type statusWriter struct {
	http.ResponseWriter
	status int
}

func (w *statusWriter) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *statusWriter) Write(b []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	return w.ResponseWriter.Write(b)
}

func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// lostAfterSend sends the first request on its way, then tells its client
// that the connection was lost: the request runs on at the server, as when
// a connection breaks after the request went out.
type lostAfterSend struct {
	base    http.RoundTripper
	started <-chan struct{} // closed when the server runs the first request
	once    sync.Once
	first   chan string // the first request's answer, as the server gave it
}

func (l *lostAfterSend) RoundTrip(r *http.Request) (*http.Response, error) {
	first := false
	l.once.Do(func() { first = true })
	if !first {
		return l.base.RoundTrip(r)
	}
	orphan := r.Clone(context.WithoutCancel(r.Context()))
	body, err := r.GetBody()
	closeRequestBody(r)
	if err != nil {
		return nil, err
	}
	orphan.Body = body
	go func() {
		resp, err := l.base.RoundTrip(orphan)
		if err != nil {
			l.first <- err.Error()
			return
		}
		l.first <- fmt.Sprintf("%d replayed=%q %s", resp.StatusCode, resp.Header.Get(idempotency.ReplayedHeader), readAll(resp))
	}()
	select {
	case <-l.started:
	case <-time.After(liveness):
		return nil, errors.New("the server never ran the first request")
	}
	return nil, errors.New("the connection was lost after the request was sent (the test's transport)")
}

func closeRequestBody(r *http.Request) {
	if r.Body != nil {
		_ = r.Body.Close()
	}
}

// The first attempt's connection is lost while the provider still runs it,
// holding the key: the retry gets 409 from HTTPMiddleware, waits its
// Retry-After and tries again under the same key, and gets the stored
// response of the first attempt.
func TestHTTPClientRetriesTheConflictOfAKeyInFlight(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 4)
	store := migratedStore(t, db, idempotency.WithInProgressWait(time.Millisecond))
	createLedger(t, db)
	started, release := make(chan struct{}), newGate()
	var execs atomic.Int64
	protected := idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		if execs.Add(1) == 1 {
			close(started)
			if err := release.wait(r.Context()); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
		}
		if _, err := idempotency.MustTxFromContext(r.Context()).Exec(r.Context(), `INSERT INTO ledger (note) VALUES ($1)`, string(body)); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, "charged "+string(body))
	}))
	var arrivals keyLog
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		sw := &statusWriter{ResponseWriter: w}
		protected.ServeHTTP(sw, r)
		arrivals.add(fmt.Sprint(r.Header.Get(idempotency.HeaderKey), " ", sw.status))
		if sw.status == http.StatusConflict {
			release.open() // the first request may finish now
		}
	}))
	t.Cleanup(srv.Close)
	t.Cleanup(release.open)
	lost := &lostAfterSend{base: srv.Client().Transport, started: started, first: make(chan string, 1)}
	hc := fastRetries(&http.Client{Transport: lost})
	waits := recordWaits(hc, true)

	resp, err := hc.Do(newPost(t, context.Background(), srv.URL+"/v1/charges", "order 14"))
	require.NoError(t, err)
	key := sentKey(resp)
	require.Equal(t, http.StatusCreated, resp.StatusCode)
	require.Equal(t, "true", resp.Header.Get(idempotency.ReplayedHeader), "the stored response of the first attempt")
	require.Equal(t, "charged order 14", readAll(resp))
	require.Equal(t, `201 replayed="" charged order 14`, await(t, lost.first, "the first attempt's answer"))

	var conflicts int
	for _, a := range arrivals.all() {
		k, code, _ := strings.Cut(a, " ")
		require.Equal(t, key, k, "every attempt carried the key")
		if code == "409" {
			conflicts++
		}
	}
	require.Positive(t, conflicts, "a retry found the key in flight")
	require.Len(t, arrivals.all(), 2+conflicts, "the first attempt, the conflicts, and the retry that got the stored response")
	require.GreaterOrEqual(t, waits()[len(waits())-1], time.Second, "after a 409, the wait was at least its Retry-After")
	require.EqualValues(t, 1, execs.Load())
	require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM ledger`))
}

// resettingServer reads each request's body whole, logs "METHOD key
// body", then closes the connection without answering.
func resettingServer(t *testing.T) (*httptest.Server, *keyLog) {
	t.Helper()
	var arrivals keyLog
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		arrivals.add(r.Method + " " + r.Header.Get(idempotency.HeaderKey) + " " + string(body))
		conn, _, err := w.(http.Hijacker).Hijack()
		if err == nil {
			_ = conn.Close()
		}
	}))
	t.Cleanup(srv.Close)
	return srv, &arrivals
}

// requireRetryError checks that err is an *HTTPRetryError of n attempts
// and returns it.
func requireRetryError(t *testing.T, err error, n int) *idempotency.HTTPRetryError {
	t.Helper()
	var re *idempotency.HTTPRetryError
	require.ErrorAs(t, err, &re)
	require.Equal(t, n, re.Attempts, "%v", err)
	return re
}

// When every attempt fails, Do's error names the key they carried and
// how many there were; every attempt sent the whole body again (GetBody);
// a body that cannot be read again is sent once; the budget stops retries
// it has no time for, and cuts an attempt still running at its end.
func TestHTTPClientGivesUpWithTheKey(t *testing.T) {
	t.Parallel()
	body := strings.Repeat("0123456789abcdef", 8<<10) // 128 KiB, more than one read

	t.Run("attempts", func(t *testing.T) {
		t.Parallel()
		srv, arrivals := resettingServer(t)
		hc := fastRetries(srv.Client())
		hc.MaxAttempts = 3
		req := newPost(t, context.Background(), srv.URL+"/v1/charges", body)
		resp, err := hc.Do(req)
		require.Nil(t, resp)
		re := requireRetryError(t, err, 3)
		_, perr := uuid.Parse(re.Key)
		require.NoError(t, perr)
		require.Contains(t, err.Error(), "3 attempts under Idempotency-Key \""+re.Key+"\", no attempts left")
		want := "POST " + re.Key + " " + body
		require.Equal(t, []string{want, want, want}, arrivals.all(), "three attempts, one key, the whole body each time")
		require.Empty(t, req.Header.Get(idempotency.HeaderKey), "the caller's request is not modified")
	})
	t.Run("the request's own key", func(t *testing.T) {
		t.Parallel()
		srv, arrivals := resettingServer(t)
		hc := fastRetries(srv.Client())
		hc.MaxAttempts = 2
		req := newPost(t, context.Background(), srv.URL+"/v1/charges", "x")
		req.Header.Set(idempotency.HeaderKey, `"order-19"`)
		_, err := hc.Do(req)
		require.Equal(t, "order-19", requireRetryError(t, err, 2).Key, "the key as the server reads it")
		require.Equal(t, []string{`POST "order-19" x`, `POST "order-19" x`}, arrivals.all(), "the header sent as it is")
	})
	t.Run("the context ends during a wait", func(t *testing.T) {
		t.Parallel()
		var arrivals atomic.Int64
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			arrivals.Add(1)
			w.Header().Set("Retry-After", "10")
			w.WriteHeader(http.StatusServiceUnavailable)
		}))
		t.Cleanup(srv.Close)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		hc := fastRetries(srv.Client())
		idempotency.SetHTTPClientWait(hc, func(ctx context.Context, d time.Duration) error {
			cancel() // the caller gives up while Do waits
			return idempotency.SleepContext(ctx, d)
		})
		_, err := hc.Do(newPost(t, ctx, srv.URL+"/v1/charges", "x"))
		requireRetryError(t, err, 1)
		require.ErrorIs(t, err, context.Canceled)
		require.Contains(t, err.Error(), "the request's context ended while waiting to retry after 503 Service Unavailable")
		require.EqualValues(t, 1, arrivals.Load())
	})
	t.Run("a GET is retried without a key", func(t *testing.T) {
		t.Parallel()
		srv, arrivals := resettingServer(t)
		hc := fastRetries(srv.Client())
		hc.MaxAttempts = 2
		req, err := http.NewRequest(http.MethodGet, srv.URL+"/v1/charges/1", nil)
		require.NoError(t, err)
		_, err = hc.Do(req)
		require.Empty(t, requireRetryError(t, err, 2).Key)
		require.Equal(t, []string{"GET  ", "GET  "}, arrivals.all())
	})
	t.Run("a method neither idempotent nor keyed is sent once", func(t *testing.T) {
		t.Parallel()
		srv, arrivals := resettingServer(t)
		req, err := http.NewRequest("PURGE", srv.URL+"/v1/cache", nil)
		require.NoError(t, err)
		_, err = fastRetries(srv.Client()).Do(req)
		require.Empty(t, requireRetryError(t, err, 1).Key)
		require.Contains(t, err.Error(), "sent once: PURGE is neither idempotent nor sent with a key")
		require.Equal(t, []string{"PURGE  "}, arrivals.all())
	})
	t.Run("no GetBody", func(t *testing.T) {
		t.Parallel()
		srv, arrivals := resettingServer(t)
		req, err := http.NewRequest(http.MethodPost, srv.URL+"/v1/charges", io.MultiReader(strings.NewReader(body)))
		require.NoError(t, err)
		require.Nil(t, req.GetBody)
		_, err = fastRetries(srv.Client()).Do(req)
		re := requireRetryError(t, err, 1)
		require.Contains(t, err.Error(), "sent once: the request's body cannot be read again (it has no GetBody)")
		require.Equal(t, []string{"POST " + re.Key + " " + body}, arrivals.all())
	})
	t.Run("no time left in the budget for the next wait", func(t *testing.T) {
		t.Parallel()
		srv, arrivals := resettingServer(t)
		hc := &idempotency.HTTPClient{Client: srv.Client(), Budget: 300 * time.Millisecond, BackoffBase: time.Second, BackoffMax: time.Second}
		_, err := hc.Do(newPost(t, context.Background(), srv.URL+"/v1/charges", "x"))
		re := requireRetryError(t, err, 1)
		require.Contains(t, err.Error(), "the budget of 300ms leaves no time for the next wait")
		require.Equal(t, []string{"POST " + re.Key + " x"}, arrivals.all())
	})
	t.Run("no time left before the deadline", func(t *testing.T) {
		t.Parallel()
		srv, arrivals := resettingServer(t)
		hc := &idempotency.HTTPClient{Client: srv.Client(), BackoffBase: time.Second, BackoffMax: time.Second}
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond) // before the budget's end
		defer cancel()
		_, err := hc.Do(newPost(t, ctx, srv.URL+"/v1/charges", "x"))
		requireRetryError(t, err, 1)
		require.Contains(t, err.Error(), "the request's deadline leaves no time")
		require.Len(t, arrivals.all(), 1)
	})
	t.Run("the budget cuts an attempt", func(t *testing.T) {
		t.Parallel()
		var arrivals atomic.Int64
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			arrivals.Add(1)
			// Read the body, so that the server watches the connection,
			// then wait until the client gives up on the request.
			_, _ = io.ReadAll(r.Body)
			select {
			case <-r.Context().Done():
			case <-time.After(liveness):
			}
		}))
		t.Cleanup(srv.Close)
		hc := &idempotency.HTTPClient{Client: srv.Client(), Budget: 200 * time.Millisecond}
		_, err := hc.Do(newPost(t, context.Background(), srv.URL+"/v1/charges", "x"))
		re := requireRetryError(t, err, 1)
		require.NotEmpty(t, re.Key)
		require.ErrorIs(t, err, context.DeadlineExceeded)
		require.Contains(t, err.Error(), "cut when the budget of 200ms ran out")
		require.EqualValues(t, 1, arrivals.Load())
	})
	t.Run("a status to retry, no attempts left", func(t *testing.T) {
		t.Parallel()
		var arrivals keyLog
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			arrivals.add(r.Header.Get(idempotency.HeaderKey))
			http.Error(w, "down", http.StatusBadGateway)
		}))
		t.Cleanup(srv.Close)
		hc := fastRetries(srv.Client())
		hc.MaxAttempts = 3
		resp, err := hc.Do(newPost(t, context.Background(), srv.URL+"/v1/charges", "x"))
		require.NoError(t, err, "a status is not an error: the last response is returned")
		require.Equal(t, http.StatusBadGateway, resp.StatusCode)
		require.Equal(t, "down\n", readAll(resp))
		key := sentKey(resp)
		require.Equal(t, []string{key, key, key}, arrivals.all())
	})
	t.Run("statuses not retried", func(t *testing.T) {
		t.Parallel()
		var arrivals atomic.Int64
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			arrivals.Add(1)
			switch r.URL.Path {
			case "/replayed":
				w.Header().Set(idempotency.ReplayedHeader, "true")
				w.WriteHeader(http.StatusInternalServerError)
			case "/501":
				w.WriteHeader(http.StatusNotImplemented)
			case "/422":
				w.WriteHeader(http.StatusUnprocessableEntity)
			}
		}))
		t.Cleanup(srv.Close)
		hc := fastRetries(srv.Client())
		for _, path := range []string{"/replayed", "/501", "/422"} {
			resp, err := hc.Do(newPost(t, context.Background(), srv.URL+path, "x"))
			require.NoError(t, err)
			_ = readAll(resp)
		}
		require.EqualValues(t, 3, arrivals.Load(), "one attempt each")
	})
}

// resending is a retrying transport of a common kind: it sends the same
// *http.Request again after an error, its body reset from GetBody.
type resending struct {
	base http.RoundTripper
	max  int
}

func (rt *resending) RoundTrip(r *http.Request) (*http.Response, error) {
	for i := 1; ; i++ {
		resp, err := rt.base.RoundTrip(r)
		if err == nil || i == rt.max || r.GetBody == nil {
			return resp, err
		}
		if r.Body, err = r.GetBody(); err != nil {
			return nil, err
		}
	}
}

// A retrying transport above HTTPTransport resends the request whose
// response the network dropped: it carries the key of the effect it
// names, so the provider replays it, and the call's next request gets its
// own effect's key.
func TestHTTPTransportBelowAResendingTransportKeepsTheKey(t *testing.T) {
	t.Parallel()
	p, _, addr := startH2CProvider(t, 0)
	proxy, url := droppingProxy(t, addr, 0, 23)
	client := &http.Client{Transport: &resending{base: &idempotency.HTTPTransport{Base: h2cTransport(t)}, max: 5}}
	store := migratedStore(t, testdb.New(t, 2))
	call := idempotency.Call{Key: "order-15", Method: "Checkout"}

	_, err := store.Execute(context.Background(), call, func(ctx context.Context, _ pgx.Tx) (proto.Message, error) {
		proxy.DropNextResponse()
		for _, body := range []string{"charge a", "charge b"} {
			if code, err := post(idempotency.WithEffect(ctx, body), client, http.MethodPost, url+"/v1/charges", body); err != nil || code != http.StatusOK {
				return nil, status.Errorf(codes.Unavailable, "%s: %d %v", body, code, err)
			}
		}
		return nil, status.Error(codes.Unavailable, "release the key, so that a re-run can read the keys")
	})
	require.Equal(t, codes.Unavailable, status.Code(err), "%v", err)
	want := effectKeys(t, store, call, "charge a", "charge b")
	require.Equal(t, []string{want[0], want[0], want[1]}, keysOf(p), "the resent request kept its key; the next request got its own")
	require.EqualValues(t, 1, proxy.Stats().ResponsesDropped)
	require.EqualValues(t, 2, p.execs.Load(), "the provider executed each charge once")
}

// bodyCloseLog is a request body that notes its closing.
type bodyCloseLog struct {
	io.Reader
	closed atomic.Bool
}

func (b *bodyCloseLog) Close() error { b.closed.Store(true); return nil }

// A request made with the context of a call that has ended is refused
// with ErrCallEnded by HTTPTransport and HTTPClient, its body closed and
// nothing sent; that context derives no keys either.
func TestRequestsWithTheContextOfAnEndedCallAreRefused(t *testing.T) {
	t.Parallel()
	p := startProvider(t)
	store := migratedStore(t, testdb.New(t, 2))
	var ended context.Context
	_, err := store.Execute(context.Background(), idempotency.Call{Key: "order-16", Method: "Checkout"}, func(ctx context.Context, _ pgx.Tx) (proto.Message, error) {
		ended = ctx
		return nil, nil
	})
	require.NoError(t, err)
	_, ok := idempotency.CountedKey(ended, "POST /v1/charges")
	require.False(t, ok, "an ended call counts no keys")
	_, ok = idempotency.EffectKey(ended, "charge")
	require.False(t, ok, "an ended call names no keys")

	for _, tc := range []struct {
		name string
		send func(*http.Request) (*http.Response, error)
	}{
		{"HTTPTransport", (&http.Client{Transport: &idempotency.HTTPTransport{}}).Do},
		{"HTTPClient", fastRetries(nil).Do},
		{"HTTPClient over HTTPTransport", fastRetries(&http.Client{Transport: &idempotency.HTTPTransport{}}).Do},
	} {
		for _, ctx := range []context.Context{ended, idempotency.WithEffect(ended, "charge")} {
			body := &bodyCloseLog{Reader: strings.NewReader("late")}
			req, err := http.NewRequestWithContext(ctx, http.MethodPost, p.url+"/v1/charges", body)
			require.NoError(t, err)
			resp, err := tc.send(req)
			require.ErrorIs(t, err, idempotency.ErrCallEnded, tc.name)
			require.Nil(t, resp)
			require.True(t, body.closed.Load(), "%s: the body of a request that is not sent is closed", tc.name)
		}
	}
	require.Empty(t, p.headers.all(), "nothing reached the provider")
}

// An invalid key, or an invalid field of the client, is refused before
// anything is sent; an explicit key wins inside a running call.
func TestHTTPClientRefusesBeforeSending(t *testing.T) {
	t.Parallel()
	p := startProvider(t)
	hc := fastRetries(nil)
	ctx := context.Background()

	withHeader := func(vals ...string) *http.Request {
		req := newPost(t, ctx, p.url+"/v1/charges", "x")
		for _, v := range vals {
			req.Header.Add(idempotency.HeaderKey, v)
		}
		return req
	}
	for name, req := range map[string]*http.Request{
		"WithOutgoingKey": newPost(t, idempotency.WithOutgoingKey(ctx, "bad key"), p.url+"/v1/charges", "x"),
		"header":          withHeader("bad key"),
		"empty header":    withHeader(""),
		"two headers":     withHeader("k-1", "k-2"),
	} {
		_, err := hc.Do(req)
		require.ErrorIs(t, err, idempotency.ErrInvalidKey, name)
		var re *idempotency.HTTPRetryError
		require.False(t, errors.As(err, &re), "%s: nothing was attempted", name)
	}
	for _, bad := range []*idempotency.HTTPClient{{MaxAttempts: -1}, {Budget: -time.Second}, {BackoffBase: -1}, {BackoffBase: time.Second, BackoffMax: time.Millisecond}} {
		_, err := bad.Do(newPost(t, ctx, p.url+"/v1/charges", "x"))
		require.ErrorContains(t, err, "idempotency: HTTPClient: ")
	}
	require.Empty(t, p.headers.all(), "nothing reached the provider")

	store := migratedStore(t, testdb.New(t, 2))
	var sent []string
	_, err := store.Execute(ctx, idempotency.Call{Key: "order-18", Method: "Checkout"}, func(ctx context.Context, _ pgx.Tx) (proto.Message, error) {
		for i, req := range []*http.Request{
			newPost(t, idempotency.WithOutgoingKey(ctx, "chosen-18"), p.url+"/v1/charges", "chosen"),
			func() *http.Request {
				r := newPost(t, idempotency.WithEffect(ctx, "named"), p.url+"/v1/charges", "own")
				r.Header.Set(idempotency.HeaderKey, `"own-18"`) // a structured-field string
				return r
			}(),
		} {
			resp, err := hc.Do(req)
			if err != nil {
				return nil, err
			}
			if body := readAll(resp); resp.StatusCode != http.StatusOK {
				return nil, fmt.Errorf("request %d: %s %s", i, resp.Status, body)
			}
			sent = append(sent, sentKey(resp))
		}
		return nil, nil
	})
	require.NoError(t, err)
	require.Equal(t, []string{"chosen-18", `"own-18"`}, sent, "the request's own header is sent as it is")
	require.Equal(t, []string{"POST chosen-18", `POST "own-18"`}, p.headers.all())
}

// A redirect (307) through a transport that answers without
// Response.Request keeps the key of the request it follows, inside a
// running call: the old address and the provider see the first effect's
// key, and the call's next request its own effect's, as if there had
// been no redirect. For HTTPTransport, HTTPClient, and the two stacked.
func TestRedirectThroughATransportWithoutResponseRequestKeepsTheKey(t *testing.T) {
	t.Parallel()
	inner := roundTripFunc(func(r *http.Request) (*http.Response, error) {
		resp, err := http.DefaultTransport.RoundTrip(r)
		if resp != nil {
			resp.Request = nil
		}
		return resp, err
	})
	for _, tc := range []struct {
		name string
		send func(*http.Request) (*http.Response, error)
	}{
		{"HTTPTransport", (&http.Client{Transport: &idempotency.HTTPTransport{Base: inner}}).Do},
		{"HTTPClient", fastRetries(&http.Client{Transport: inner}).Do},
		{"HTTPClient over HTTPTransport", fastRetries(&http.Client{Transport: &idempotency.HTTPTransport{Base: inner}}).Do},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p := startProvider(t)
			var moved keyLog
			old := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				moved.add(r.Header.Get(idempotency.HeaderKey))
				http.Redirect(w, r, p.url+r.URL.Path, http.StatusTemporaryRedirect)
			}))
			t.Cleanup(old.Close)
			store := migratedStore(t, testdb.New(t, 2))
			call := idempotency.Call{Key: "order-17", Method: "Checkout"}

			var sent []string
			_, err := store.Execute(context.Background(), call, func(ctx context.Context, _ pgx.Tx) (proto.Message, error) {
				for i, base := range []string{old.URL, p.url} {
					body := fmt.Sprint("charge ", i)
					resp, err := tc.send(newPost(t, idempotency.WithEffect(ctx, body), base+"/v1/charges", body))
					if err != nil {
						return nil, err
					}
					if body := readAll(resp); resp.StatusCode != http.StatusOK {
						return nil, fmt.Errorf("request %d: %s %s", i, resp.Status, body)
					}
					require.NotNil(t, resp.Request)
					sent = append(sent, sentKey(resp))
				}
				return nil, status.Error(codes.Unavailable, "release the key, so that a re-run can read the keys")
			})
			require.Equal(t, codes.Unavailable, status.Code(err), "%v", err)
			want := effectKeys(t, store, call, "charge 0", "charge 1")
			require.Equal(t, want[:1], moved.all(), "the old address got the first effect's key")
			require.Equal(t, []string{"POST " + want[0], "POST " + want[1]}, p.headers.all(), "the redirect kept the key")
			require.Equal(t, want, sent, "each response's Request carries its key")
			require.EqualValues(t, 2, p.execs.Load())
		})
	}
}

// HTTPClient's Budget bounds the whole Do: a server that answers 503 (or
// 409, 429) and then never finishes the response's body cannot hold Do in
// the drain of that body before the retry. (It failed when nothing bounded
// the drain.)
func TestHTTPClientBudgetBoundsTheDrainOfARetriedResponse(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	var requests atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if requests.Add(1) == 1 {
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = w.Write([]byte("overloaded, details follow"))
			w.(http.Flusher).Flush()
			select { // the rest of the body never comes while the test waits
			case <-release:
			case <-r.Context().Done():
			}
			return
		}
		_, _ = w.Write([]byte("ok"))
	}))
	t.Cleanup(srv.Close)

	hc := &idempotency.HTTPClient{Budget: 300 * time.Millisecond, BackoffBase: 10 * time.Millisecond}
	type outcome struct {
		resp *http.Response
		err  error
	}
	done := make(chan outcome, 1)
	start := time.Now()
	go func() {
		req, err := http.NewRequest(http.MethodPost, srv.URL+"/v1/charges", strings.NewReader("charge"))
		if err != nil {
			done <- outcome{err: err}
			return
		}
		resp, err := hc.Do(req)
		done <- outcome{resp, err}
	}()
	t.Cleanup(func() { // let Do finish, so that the test leaks nothing
		close(release)
		o := <-done
		if o.resp != nil {
			_ = o.resp.Body.Close()
		}
	})
	select {
	case o := <-done:
		done <- o
		require.Less(t, time.Since(start), 3*time.Second)
	case <-time.After(3 * time.Second):
		t.Fatalf("Do with a budget of %v still running after %v: held by the drain of a retried response's body", hc.Budget, time.Since(start).Round(time.Millisecond))
	}
}

// A 503 with Retry-After 2 whose body trickles, under a 3 s budget: the
// body is drained during the wait and cut when it ends, so Do is not held
// past its budget. (It failed when the drain came before the whole wait,
// and Do returned after 4 s.)
func TestHTTPClientSlowDrainStaysWithinTheBudget(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	var requests atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if requests.Add(1) == 1 {
			w.Header().Set("Retry-After", "2")
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = w.Write([]byte("overloaded, details follow"))
			w.(http.Flusher).Flush()
			select {
			case <-release:
			case <-r.Context().Done():
			}
			return
		}
		_, _ = w.Write([]byte("ok"))
	}))
	t.Cleanup(srv.Close)
	t.Cleanup(func() { close(release) })

	budget := 3 * time.Second
	hc := &idempotency.HTTPClient{Budget: budget, BackoffBase: 10 * time.Millisecond}
	req, err := http.NewRequest(http.MethodPost, srv.URL+"/v1/charges", strings.NewReader("charge"))
	require.NoError(t, err)
	start := time.Now()
	resp, err := hc.Do(req)
	took := time.Since(start)
	if resp != nil {
		_ = resp.Body.Close()
	}
	t.Logf("Do returned after %v (budget %v): %v", took.Round(time.Millisecond), budget, err)
	require.Less(t, took, budget+500*time.Millisecond, "Do overran its budget")
}

// A goroutine the handler left running calls Do; its first attempt gets a
// 503 after the handler returned. Do sends no retry under the key it
// derived for the ended call: ErrCallEnded, as HTTPTransport refuses a
// redirect hop then. (It failed when the retry was sent.)
func TestHTTPClientSendsNoRetryAfterTheCallEnded(t *testing.T) {
	t.Parallel()
	arrived, release := make(chan struct{}), newGate()
	var mu sync.Mutex
	var keys []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		keys = append(keys, r.Header.Get(idempotency.HeaderKey))
		n := len(keys)
		mu.Unlock()
		if n == 1 {
			close(arrived)
			_ = release.wait(r.Context())
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusOK)
	}))
	t.Cleanup(srv.Close)
	t.Cleanup(release.open)
	store := migratedStore(t, testdb.New(t, 2))
	hc := &idempotency.HTTPClient{BackoffBase: time.Millisecond, BackoffMax: time.Millisecond}
	done := make(chan error, 1)
	_, err := store.Execute(context.Background(), idempotency.Call{Key: "order-5", Method: "m"}, func(ctx context.Context, _ pgx.Tx) (proto.Message, error) {
		go func() {
			req, err := http.NewRequestWithContext(idempotency.WithEffect(ctx, "charge"), http.MethodPost, srv.URL+"/v1/charges", strings.NewReader("charge"))
			if err != nil {
				done <- err
				return
			}
			resp, err := hc.Do(req)
			if resp != nil {
				_ = resp.Body.Close()
			}
			done <- err
		}()
		<-arrived // the first attempt went out while the call ran
		return nil, nil
	})
	require.NoError(t, err)
	release.open() // the call has ended: now the first attempt fails
	err = await(t, done, "the goroutine's Do")
	mu.Lock()
	defer mu.Unlock()
	require.Len(t, keys, 1, "an attempt made after the call ended was sent with the derived key %q", keys[0])
	require.ErrorIs(t, err, idempotency.ErrCallEnded)
}
