package idempotency_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// Attacks on the promises of derived keys and HTTPClient that held.

// 16 goroutines derive keys and send requests with the handler's context
// while it returns: no race, no panic; once Execute has returned, every
// derivation says false and every request is refused with ErrCallEnded,
// nothing sent.
func TestDerivingWhileTheHandlerReturns(t *testing.T) {
	t.Parallel()
	store := migratedStore(t, testdb.New(t, 2))
	var sentAfter atomic.Int64
	var ended atomic.Bool
	tr := &idempotency.HTTPTransport{Base: roundTripFunc(func(r *http.Request) (*http.Response, error) {
		if ended.Load() {
			sentAfter.Add(1)
		}
		return &http.Response{StatusCode: http.StatusOK, Body: http.NoBody, Request: r}, nil
	})}
	hc := &idempotency.HTTPClient{Client: &http.Client{Transport: tr}}
	for round := range 20 {
		var wg sync.WaitGroup
		stop := make(chan struct{})
		var afterEnd atomic.Int64 // derivations started after Execute returned that got a key
		ended.Store(false)
		_, err := store.Execute(context.Background(), idempotency.Call{Key: fmt.Sprintf("k-%d", round), Method: "m"}, func(ctx context.Context, _ pgx.Tx) (proto.Message, error) {
			for i := range 16 {
				wg.Go(func() {
					for n := 0; ; n++ {
						select {
						case <-stop:
							return
						default:
						}
						after := ended.Load()
						_, ok1 := idempotency.EffectKey(ctx, fmt.Sprint("e", i))
						_, ok2 := idempotency.CountedKey(ctx, "t")
						req, _ := http.NewRequestWithContext(idempotency.WithEffect(ctx, "x"), http.MethodPost, "http://p.invalid/v1", strings.NewReader("b"))
						var err error
						if i%2 == 0 {
							_, err = tr.RoundTrip(req)
						} else {
							var resp *http.Response
							if resp, err = hc.Do(req); err == nil {
								_ = resp.Body.Close()
							}
						}
						if after && (ok1 || ok2 || !errors.Is(err, idempotency.ErrCallEnded)) {
							afterEnd.Add(1)
						}
					}
				})
			}
			time.Sleep(time.Millisecond)
			return nil, nil
		})
		ended.Store(true)
		require.NoError(t, err)
		time.Sleep(2 * time.Millisecond)
		close(stop)
		wg.Wait()
		require.Zero(t, afterEnd.Load(), "nothing derived or sent once the call has ended")
	}
	// A request whose key was taken before the end may still reach Base
	// after it (it was made while the call ran): sentAfter only counts them.
	t.Logf("requests that reached Base after Execute returned, made before: %d", sentAfter.Load())
}

// A request's map entries in any order and an Any whose packed message
// (its type linked in) has its fields in another order: one request, one
// set of keys.
func TestMapAndAnyOrderKeepTheKeys(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 8)
	store := migratedStore(t, db)
	amount := review2Field("amount", 1, descriptorpb.FieldDescriptorProto_TYPE_INT64, false)
	anyField := review2Field("extra", 4, descriptorpb.FieldDescriptorProto_TYPE_MESSAGE, false)
	anyField.TypeName = proto.String(".google.protobuf.Any")
	md := review2SchemaWith(t, []string{"google/protobuf/any.proto"}, amount, anyField)
	oldMd := review2Schema(t, "proto3", amount)
	var keys, oldKeys keyLog
	conn := review2PayServer(t, store, md, &keys, crashes)
	oldConn := review2PayServer(t, store, oldMd, &oldKeys, crashes)

	entries := make([][]byte, 64)
	for i := range entries {
		entries[i] = bytesField(nil, 1, append(bytesField(nil, 1, []byte(fmt.Sprintf("k%02d", i))),
			bytesField(nil, 2, bytesField(nil, 3, []byte(fmt.Sprintf("v%02d", i))))...)) // Struct.fields entry {key: Value{string_value}}
	}
	inner := func(order []int) []byte {
		var b []byte
		for _, i := range order {
			b = append(b, entries[i]...)
		}
		return b
	}
	encode := func(order []int, innerFirst bool) []byte {
		st := inner(order)
		var anyBytes []byte
		if innerFirst {
			anyBytes = bytesField(bytesField(nil, 2, st), 1, []byte("type.googleapis.com/google.protobuf.Struct"))
		} else {
			anyBytes = bytesField(bytesField(nil, 1, []byte("type.googleapis.com/google.protobuf.Struct")), 2, st)
		}
		return varintField(bytesField(nil, 4, anyBytes), 1, 500)
	}
	order := rand.Perm(len(entries))
	sorted := make([]int, len(entries))
	for i := range sorted {
		sorted[i] = i
	}
	for _, b := range [][]byte{encode(sorted, false), encode(order, true), encode(rand.Perm(len(entries)), false)} {
		require.Equal(t, codes.Unavailable, status.Code(sendRaw(conn, "order-1", b).err))
		require.Equal(t, codes.Unavailable, status.Code(sendRaw(oldConn, "order-1", b).err))
	}
	k, ok := keys.all(), oldKeys.all()
	require.Equal(t, []string{k[0], k[0], k[0]}, k)
	// A build that does not declare the field holds the Any as unknown
	// bytes, in the client's order, and derives a key per order (a limit,
	// see requestDigest): it is not compared here.
	require.Len(t, ok, 3)

	// The Any decodes as the Struct it packs.
	a := &anypb.Any{Value: inner(order), TypeUrl: "type.googleapis.com/google.protobuf.Struct"}
	st := &structpb.Struct{}
	require.NoError(t, a.UnmarshalTo(st))
	require.Len(t, st.GetFields(), len(entries))
}

// review2SchemaWith is review2Schema in a file with dependencies.
func review2SchemaWith(t *testing.T, deps []string, fields ...*descriptorpb.FieldDescriptorProto) protoreflect.MessageDescriptor {
	t.Helper()
	msg := &descriptorpb.DescriptorProto{Name: proto.String("PayRequest"), Field: fields}
	fd, err := protodesc.NewFile(&descriptorpb.FileDescriptorProto{
		Name: proto.String("idempotency/test/pay.proto"), Package: proto.String("idempotency.test"),
		Syntax: proto.String("proto3"), Dependency: deps, MessageType: []*descriptorpb.DescriptorProto{msg},
	}, protoregistry.GlobalFiles)
	require.NoError(t, err)
	return fd.Messages().Get(0)
}

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

// Reading Config hands out no connection (the next call gets the same
// backend), and works on a savepoint.
func TestConfigHandsOutNoConnection(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 1)
	store := migratedStore(t, db)
	pid := func(key string, read bool) (p int) {
		_, err := store.Execute(context.Background(), idempotency.Call{Key: key, Method: "m"}, func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
			if read {
				require.NotNil(t, tx.(review2Configured).Config())
				sp, err := tx.Begin(ctx)
				require.NoError(t, err)
				require.NotNil(t, sp.(review2Configured).Config())
				require.NoError(t, sp.Commit(ctx))
			}
			return nil, tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&p)
		})
		require.NoError(t, err)
		return p
	}
	first := pid("a", true)
	require.Equal(t, first, pid("b", false), "the connection went back to the pool")
}

// Derived keys of HTTP requests and messages: the same request derives
// the same keys, another query or body others; all 44 printable
// characters, valid keys.
func TestHTTPAndMessageDerivedKeys(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 4)
	store := migratedStore(t, db)
	var keys keyLog
	h := idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		k, _ := idempotency.EffectKey(r.Context(), "charge")
		keys.add(k)
		http.Error(w, "down", http.StatusServiceUnavailable) // releases the key
	}))
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	send := func(path, body string) {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+path, strings.NewReader(body))
		req.Header.Set(idempotency.HeaderKey, `"order-1"`)
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		_ = readAll(resp)
	}
	send("/v1/charges?a=1", "x")
	send("/v1/charges?a=1", "x")
	send("/v1/charges?a=2", "x")
	send("/v1/charges?a=1", "y")
	msg := func(body string) {
		_, err := store.ProcessMessage(context.Background(), idempotency.Message{ID: "order-1", Body: []byte(body)}, func(ctx context.Context, _ pgx.Tx) error {
			k, _ := idempotency.EffectKey(ctx, "charge")
			keys.add(k)
			return errRelease
		})
		require.ErrorIs(t, err, errRelease)
	}
	msg("x")
	msg("x")
	msg("y")
	k := keys.all()
	require.Len(t, k, 7)
	require.Equal(t, k[0], k[1])
	require.Equal(t, k[4], k[5])
	requireDerived(t, []string{k[0], k[2], k[3], k[4], k[6]}, "order-1")
	for _, key := range k {
		require.Len(t, key, 44)
	}
}
