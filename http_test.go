package idempotency_test

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"net/textproto"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/faultproxy"
	"github.com/exactlyonce/idempotency/internal/testdb"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
)

// The HTTP middleware over a real net/http server on loopback, a real
// client and the real database.

// httpEnv is one test's HTTP world: the suite's ledger table, a store, and
// a server whose POST /v1/charges handler writes one ledger row in the
// request's transaction.
type httpEnv struct {
	t       *testing.T
	db      *testdb.DB
	store   *idempotency.Store
	srv     *httptest.Server
	runs    atomic.Int64
	arrived atomic.Int64 // requests that reached the server, before the middleware
}

func newHTTPEnv(t *testing.T, handler http.HandlerFunc, opts ...idempotency.HTTPOption) *httpEnv {
	t.Helper()
	return newHTTPEnvWithStore(t, handler, nil, opts...)
}

func newHTTPEnvWithStore(t *testing.T, handler http.HandlerFunc, storeOpts []idempotency.StoreOption, opts ...idempotency.HTTPOption) *httpEnv {
	t.Helper()
	e := &httpEnv{t: t, db: suiteDB(t)}
	e.store = migratedStore(t, e.db, storeOpts...)
	if handler == nil {
		handler = e.charge
	}
	counted := func(w http.ResponseWriter, r *http.Request) {
		e.runs.Add(1)
		handler(w, r)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /v1/charges", idempotency.HTTPMiddleware(e.store, opts...)(http.HandlerFunc(counted)))
	mux.Handle("GET /v1/charges", idempotency.HTTPMiddleware(e.store, opts...)(http.HandlerFunc(counted)))
	e.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		e.arrived.Add(1)
		mux.ServeHTTP(w, r)
	}))
	t.Cleanup(e.srv.Close)
	return e
}

// charge writes a ledger row named by the request body and answers 201
// with its id, a Location and a header that is not replayed.
func (e *httpEnv) charge(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	if len(body) == 0 {
		http.Error(w, "empty body", http.StatusBadRequest)
		return
	}
	key := r.Header.Get(idempotency.HeaderKey)
	var id int64
	if err := idempotency.MustTxFromContext(r.Context()).QueryRow(r.Context(),
		`INSERT INTO ledger (note, key) VALUES ($1, $2) RETURNING id`, string(body), key).Scan(&id); err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Location", fmt.Sprintf("/v1/charges/%d", id))
	w.Header().Set("X-Served-At", time.Now().Format(time.RFC3339Nano))
	w.WriteHeader(http.StatusCreated)
	_, _ = fmt.Fprintf(w, `{"id":%d,"note":%q}`, id, body)
}

type httpReply struct {
	status int
	header http.Header
	body   string
}

func (e *httpEnv) post(key, body string) httpReply {
	return e.send(http.MethodPost, key, body)
}

func (e *httpEnv) send(method, key, body string) httpReply {
	e.t.Helper()
	req, err := http.NewRequest(method, e.srv.URL+"/v1/charges", strings.NewReader(body))
	require.NoError(e.t, err)
	if key != "" {
		req.Header.Set(idempotency.HeaderKey, key)
	}
	resp, err := e.srv.Client().Do(req)
	require.NoError(e.t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(e.t, err)
	return httpReply{resp.StatusCode, resp.Header, string(b)}
}

func (e *httpEnv) ledgerRows() int { return e.db.Count(e.t, `SELECT count(*) FROM ledger`) }

func TestHTTPReplayIsByteIdentical(t *testing.T) {
	t.Parallel()
	e := newHTTPEnv(t, nil)
	first := e.post("k-1", "charge 100")
	require.Equal(t, http.StatusCreated, first.status)
	require.Empty(t, first.header.Get(idempotency.ReplayedHeader))
	for _, key := range []string{"k-1", `"k-1"`} { // a bare token, and the draft's structured-field string
		again := e.post(key, "charge 100")
		require.Equal(t, first.status, again.status, key)
		require.Equal(t, first.body, again.body, "%s: the body, byte for byte", key)
		require.Equal(t, "true", again.header.Get(idempotency.ReplayedHeader))
		require.Equal(t, first.header.Get("Content-Type"), again.header.Get("Content-Type"))
		require.Equal(t, first.header.Get("Location"), again.header.Get("Location"))
		require.Empty(t, again.header.Get("X-Served-At"), "headers outside the allow-list belong to the first response")
	}
	require.EqualValues(t, 1, e.runs.Load())
	require.Equal(t, 1, e.ledgerRows())

	// Methods RFC 9110 makes idempotent pass through.
	get := e.send(http.MethodGet, "k-1", "")
	require.Equal(t, http.StatusBadRequest, get.status, "GET reached the handler, which wants a body")
	require.Empty(t, get.header.Get(idempotency.ReplayedHeader))
}

func TestHTTPErrorsAreProblemDetails(t *testing.T) {
	t.Parallel()
	e := newHTTPEnv(t, nil)
	require.Equal(t, http.StatusCreated, e.post("k", "charge 100").status)
	for _, tc := range []struct {
		name, key, body string
		status          int
		title, reason   string
	}{
		{"same key, another body", "k", "charge 999", http.StatusUnprocessableEntity, "Idempotency-Key already used for another request", "KEY_REUSED"},
		{"no key", "", "charge 1", http.StatusBadRequest, "Invalid or missing Idempotency-Key", "MISSING_KEY"},
		{"invalid key", "has space", "charge 1", http.StatusBadRequest, "Invalid or missing Idempotency-Key", "INVALID_KEY"},
		{"bad structured string", `"unterminated`, "charge 1", http.StatusBadRequest, "Invalid or missing Idempotency-Key", "INVALID_KEY"},
	} {
		r := e.post(tc.key, tc.body)
		require.Equal(t, tc.status, r.status, tc.name)
		require.Equal(t, "application/problem+json", r.header.Get("Content-Type"), tc.name)
		var p struct {
			Type, Title, Detail, Reason string
			Status                      int
		}
		require.NoError(t, json.Unmarshal([]byte(r.body), &p), tc.name)
		require.Equal(t, tc.status, p.Status, tc.name)
		require.Equal(t, tc.title, p.Title, tc.name)
		require.Equal(t, tc.reason, p.Reason, "%s: the library's answer says which it is", tc.name)
		require.NotEmpty(t, p.Detail, tc.name)
	}
	require.EqualValues(t, 1, e.runs.Load(), "none of them reached the handler")

	req, _ := http.NewRequest(http.MethodPost, e.srv.URL+"/v1/charges", strings.NewReader("x"))
	req.Header.Add(idempotency.HeaderKey, "a")
	req.Header.Add(idempotency.HeaderKey, "b")
	resp, err := e.srv.Client().Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusBadRequest, resp.StatusCode, "two keys")
}

// Hundreds of duplicates at once: one execution. Each duplicate waits for
// it and gets the replay or, past the in-progress wait, 409 with
// Retry-After. The first request is held until every request has reached
// the server, or every duplicate has its 409.
func TestHTTPConcurrentDuplicates(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name      string
		wait      time.Duration
		conflicts bool // every duplicate gets 409
	}{
		{"duplicates wait and replay", liveness, false},
		{"duplicates give up with 409", 20 * time.Millisecond, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var e *httpEnv
			release := newGate()
			defer release.open()
			e = newHTTPEnvWithStore(t, func(w http.ResponseWriter, r *http.Request) {
				if err := release.wait(r.Context()); err != nil {
					http.Error(w, err.Error(), http.StatusInternalServerError)
					return
				}
				e.charge(w, r)
			}, []idempotency.StoreOption{idempotency.WithInProgressWait(tc.wait), idempotency.WithSuggestedRetryDelay(1500 * time.Millisecond)})
			const n = 200
			replies := make([]httpReply, n)
			post := func(i int) { replies[i] = e.post("dup", "charge 5") }
			if tc.conflicts {
				heldDuplicates(t, n, release, post, func(back int64) bool { return back == n-1 }, "every duplicate gets 409 while the first request runs")
			} else {
				heldDuplicates(t, n, release, post, func(int64) bool { return e.arrived.Load() == n }, "every request reaches the server while the first one runs")
			}
			var created, replayed, conflicts int
			for _, r := range replies {
				switch {
				case r.status == http.StatusCreated && r.header.Get(idempotency.ReplayedHeader) == "":
					created++
				case r.status == http.StatusCreated:
					replayed++
				case r.status == http.StatusConflict:
					conflicts++
					require.Equal(t, "2", r.header.Get("Retry-After"), "the retry delay, in whole seconds rounded up")
					require.Equal(t, "application/problem+json", r.header.Get("Content-Type"))
					require.Contains(t, r.body, `"reason":"KEY_IN_PROGRESS"`, "the library's 409, not a handler's")
				default:
					t.Fatalf("unexpected reply %d: %s", r.status, r.body)
				}
			}
			require.Equal(t, 1, created)
			if tc.conflicts {
				require.Equal(t, n-1, conflicts)
			} else {
				require.Equal(t, n-1, replayed)
			}
			require.EqualValues(t, 1, e.runs.Load())
			require.Equal(t, 1, e.ledgerRows())
		})
	}
}

// Which handler responses are stored: 2xx always, 5xx never, 4xx as on the
// gRPC side. The writes of a success commit; those of a stored 4xx roll
// back, as a gRPC handler's final error's do; those of a response that is
// not stored roll back with the released key.
func TestHTTPStoredStatuses(t *testing.T) {
	t.Parallel()
	var e *httpEnv
	e = newHTTPEnv(t, func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		tx := idempotency.MustTxFromContext(r.Context())
		_, err := tx.Exec(r.Context(), `INSERT INTO ledger (note, key) VALUES ($1, 'k')`, string(body))
		require.NoError(t, err)
		if string(body) == "conflict after a failed statement" {
			_, err := tx.Exec(r.Context(), `INSERT INTO ledger (id, note, key) VALUES (1, 'a', 'k'), (1, 'b', 'k')`)
			require.Error(t, err, "the transaction is aborted now")
			w.WriteHeader(http.StatusConflict)
			return
		}
		code, _ := strconv.Atoi(string(body))
		w.WriteHeader(http.StatusEarlyHints) // informational: not the answer
		w.WriteHeader(code)
		_, _ = fmt.Fprintf(w, "status %d run %d", code, e.runs.Load())
	})
	for _, tc := range []struct {
		body    string
		status  int
		stored  bool
		commits bool
	}{
		{"200", 200, true, true}, {"201", 201, true, true}, {"303", 303, true, true},
		{"404", 404, true, false}, {"409", 409, true, false}, {"412", 412, true, false},
		{"400", 400, false, false}, {"401", 401, false, false}, {"422", 422, false, false},
		{"429", 429, false, false}, {"500", 500, false, false}, {"503", 503, false, false},
		{"conflict after a failed statement", 409, true, false},
	} {
		key := "s-" + strings.ReplaceAll(tc.body, " ", "-")
		first := e.post(key, tc.body)
		again := e.post(key, tc.body)
		require.Equal(t, tc.status, first.status, tc.body)
		require.Equal(t, tc.status, again.status, tc.body)
		require.Equal(t, tc.stored, again.header.Get(idempotency.ReplayedHeader) == "true", "%s stored", tc.body)
		require.Equal(t, tc.stored, first.body == again.body, tc.body)
		rows := e.db.Count(t, `SELECT count(*) FROM ledger WHERE note = $1`, tc.body)
		if tc.commits {
			require.Equal(t, 1, rows, "%s: the write of a success commits", tc.body)
		} else {
			require.Equal(t, 0, rows, "%s: the write rolls back", tc.body)
		}
	}
}

// A status net/http would refuse is the handler's bug: it panics, as
// net/http's own writer does, and the key is released.
func TestHTTPInvalidStatusPanics(t *testing.T) {
	t.Parallel()
	e := newHTTPEnv(t, func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(1000) })
	req, _ := http.NewRequest(http.MethodPost, e.srv.URL+"/v1/charges", strings.NewReader("x"))
	req.Header.Set(idempotency.HeaderKey, "k")
	_, err := e.srv.Client().Do(req)
	require.Error(t, err, "the server aborted the response")
	require.Zero(t, e.db.Count(t, `SELECT count(*) FROM idempotency_keys`))
}

// The response writer's edges: what the client sees first is what a replay
// shows.
func TestHTTPResponseWriterMatrix(t *testing.T) {
	t.Parallel()
	handlers := map[string]http.HandlerFunc{
		"WriteHeader twice": func(w http.ResponseWriter, _ *http.Request) {
			w.WriteHeader(http.StatusAccepted)
			w.WriteHeader(http.StatusTeapot) // ignored, as net/http ignores it
			_, _ = io.WriteString(w, "accepted")
		},
		"no WriteHeader": func(w http.ResponseWriter, _ *http.Request) {
			_, _ = io.WriteString(w, "implicit 200")
		},
		"Write before WriteHeader": func(w http.ResponseWriter, _ *http.Request) {
			_, _ = io.WriteString(w, "first")
			w.WriteHeader(http.StatusCreated) // too late: the status is 200
			_, _ = io.WriteString(w, " second")
		},
		"writes nothing": func(http.ResponseWriter, *http.Request) {},
		"headers after the body": func(w http.ResponseWriter, _ *http.Request) {
			_, _ = io.WriteString(w, `{"a":1}`)
			w.Header().Set("Location", "/late") // too late for net/http too
		},
	}
	want := map[string][2]any{
		"WriteHeader twice":        {http.StatusAccepted, "accepted"},
		"no WriteHeader":           {http.StatusOK, "implicit 200"},
		"Write before WriteHeader": {http.StatusOK, "first second"},
		"writes nothing":           {http.StatusOK, ""},
		"headers after the body":   {http.StatusOK, `{"a":1}`},
	}
	for name, h := range handlers {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := newHTTPEnv(t, h)
			first := e.post("k", "x")
			again := e.post("k", "x")
			require.Equal(t, want[name][0], first.status)
			require.Equal(t, want[name][1], first.body)
			require.Equal(t, first.status, again.status)
			require.Equal(t, first.body, again.body)
			require.Equal(t, first.header.Get("Content-Type"), again.header.Get("Content-Type"))
			require.Equal(t, first.header.Get("Location"), again.header.Get("Location"))
			require.Equal(t, "true", again.header.Get(idempotency.ReplayedHeader))
			require.EqualValues(t, 1, e.runs.Load())
		})
	}
}

// Streaming fails clearly and a response over the cap is never half-stored.
func TestHTTPStreamingAndOversizeFailClearly(t *testing.T) {
	t.Parallel()
	errs := make(chan [3]error, 1)
	var e *httpEnv
	e = newHTTPEnv(t, func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		_, err := idempotency.MustTxFromContext(r.Context()).Exec(r.Context(), `INSERT INTO ledger (note, key) VALUES ($1, 'k')`, string(body))
		require.NoError(t, err)
		if string(body) == "stream" {
			rc := http.NewResponseController(w)
			_, _, hijackErr := rc.Hijack()
			errs <- [3]error{rc.Flush(), hijackErr, rc.EnableFullDuplex()}
			_, isFlusher := w.(http.Flusher)
			require.False(t, isFlusher, "no Flush to call by accident")
			require.NoError(t, rc.SetWriteDeadline(time.Now().Add(time.Minute)), "deadlines still work")
			_, _ = io.WriteString(w, "whole")
			return
		}
		_, _ = w.Write(make([]byte, 600))
		_, _ = w.Write(make([]byte, 600)) // over the 1000-byte cap
	}, idempotency.WithHTTPMaxResponseBytes(1000))

	r := e.post("stream", "stream")
	require.Equal(t, http.StatusOK, r.status)
	require.Equal(t, "whole", r.body)
	for _, err := range <-errs {
		require.ErrorContains(t, err, "cannot be streamed")
	}

	big := e.post("big", "big")
	require.Equal(t, http.StatusInternalServerError, big.status)
	require.Contains(t, big.body, "over 1000 bytes")
	require.Equal(t, 0, e.db.Count(t, `SELECT count(*) FROM ledger WHERE note = 'big'`), "its write rolled back")
	require.Equal(t, 0, e.db.Count(t, `SELECT count(*) FROM idempotency_keys WHERE key = 'big'`), "nothing half-stored")
}

// A panicking handler releases the key; the retry runs at once.
func TestHTTPPanicReleasesTheKey(t *testing.T) {
	t.Parallel()
	var e *httpEnv
	e = newHTTPEnv(t, func(w http.ResponseWriter, r *http.Request) {
		if e.runs.Load() == 1 {
			_, _ = idempotency.MustTxFromContext(r.Context()).Exec(r.Context(), `INSERT INTO ledger (note, key) VALUES ('panicked', 'k')`)
			panic(http.ErrAbortHandler) // net/http's way to abort quietly
		}
		e.charge(w, r)
	})
	req, _ := http.NewRequest(http.MethodPost, e.srv.URL+"/v1/charges", strings.NewReader("x"))
	req.Header.Set(idempotency.HeaderKey, "k")
	_, err := e.srv.Client().Do(req)
	require.Error(t, err, "the aborted response")
	require.Zero(t, heldKeyLocks(t, e.db, "", []string{"http k"}), "the panicking request's lock was released before its connection was dropped")
	r := e.post("k", "x")
	require.Equal(t, http.StatusCreated, r.status)
	require.Empty(t, r.header.Get(idempotency.ReplayedHeader), "the retry ran")
	require.Equal(t, 1, e.ledgerRows(), "the panicked write rolled back")
}

// While PostgreSQL refuses connections: 503 with Retry-After, the handler
// not run; after, the same key runs.
func TestHTTPDatabaseDownIs503(t *testing.T) {
	t.Parallel()
	db := suiteDB(t)
	proxy, err := faultproxy.New(pgAddress(t))
	require.NoError(t, err)
	t.Cleanup(func() { _ = proxy.Close() })
	pool := schemaPool(t, db.Schema, 4, func(c *pgxpool.Config) {
		host, port, _ := net.SplitHostPort(proxy.Addr())
		c.ConnConfig.Host = host
		p, _ := strconv.Atoi(port)
		c.ConnConfig.Port = uint16(p)
		c.ConnConfig.ConnectTimeout = 2 * time.Second
	})
	store, err := idempotency.NewStore(pool)
	require.NoError(t, err)
	e := &httpEnv{t: t, db: db, store: store}
	e.srv = httptest.NewServer(idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		e.runs.Add(1)
		e.charge(w, r)
	})))
	t.Cleanup(e.srv.Close)

	proxy.SetRefusing(true)
	proxy.CutAll()
	r := e.post("k", "x")
	require.Equal(t, http.StatusServiceUnavailable, r.status, r.body)
	require.NotEmpty(t, r.header.Get("Retry-After"))
	require.Equal(t, "application/problem+json", r.header.Get("Content-Type"))
	require.EqualValues(t, 0, e.runs.Load())

	proxy.SetRefusing(false)
	require.Equal(t, http.StatusCreated, e.post("k", "x").status)
	require.Equal(t, 1, e.ledgerRows())
}

// httpCrashChildEnv makes the test binary serve HTTP as the crash test's
// child: on the listening socket it inherits as fd 3, with a store on the
// schema the variable names, a handler that kills the process after its
// business write.
const httpCrashChildEnv = "IDEMPOTENCY_HTTP_CRASH_CHILD"

func runHTTPCrashChild() int {
	cfg, err := pgxpool.ParseConfig(testdb.URL())
	if err != nil {
		return 2
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = os.Getenv(httpCrashChildEnv)
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		return 2
	}
	store, err := idempotency.NewStore(pool)
	if err != nil {
		return 2
	}
	lis, err := net.FileListener(os.NewFile(3, "listener"))
	if err != nil {
		return 2
	}
	fmt.Println("ready")
	_ = http.Serve(lis, idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) {
		_, err := idempotency.MustTxFromContext(r.Context()).Exec(r.Context(), `INSERT INTO ledger (note, key) VALUES ('crashed', 'k')`)
		if err == nil {
			_ = syscall.Kill(os.Getpid(), syscall.SIGKILL) // between the claim and the commit
			select {}
		}
	})))
	return 1
}

// A server killed between the claim and the commit leaves no stuck key:
// the retry, on another server, runs at once and exactly once.
func TestHTTPServerKilledBeforeCommitLeavesNoKey(t *testing.T) {
	t.Parallel()
	db := suiteDB(t)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	lisFile, err := lis.(*net.TCPListener).File()
	require.NoError(t, err)
	_ = lis.Close()
	child := exec.Command(os.Args[0], "-test.run=^$")
	child.Env = append(os.Environ(), httpCrashChildEnv+"="+db.Schema)
	child.ExtraFiles = []*os.File{lisFile}
	out, err := child.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, child.Start())
	_ = lisFile.Close()
	line, err := bufio.NewReader(out).ReadString('\n')
	require.NoError(t, err)
	require.Equal(t, "ready\n", line)

	req, _ := http.NewRequest(http.MethodPost, "http://"+lis.Addr().String()+"/v1/charges", strings.NewReader("x"))
	req.Header.Set(idempotency.HeaderKey, "k")
	_, err = http.DefaultClient.Do(req)
	require.Error(t, err, "the server died mid-request")
	err = child.Wait()
	var exit *exec.ExitError
	require.ErrorAs(t, err, &exit)
	require.Equal(t, syscall.SIGKILL, exit.Sys().(syscall.WaitStatus).Signal())
	require.Equal(t, 0, db.Count(t, `SELECT count(*) FROM ledger`), "its write died with it")

	var e *httpEnv
	e = &httpEnv{t: t, db: db, store: migratedStore(t, db)}
	e.srv = httptest.NewServer(idempotency.HTTPMiddleware(e.store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		e.runs.Add(1)
		e.charge(w, r)
	})))
	t.Cleanup(e.srv.Close)
	// A key left held by the dead process would answer 409 (in progress).
	r := e.post("k", "x")
	require.Equal(t, http.StatusCreated, r.status, "no key was left held by the dead process")
	require.Empty(t, r.header.Get(idempotency.ReplayedHeader), "the retry ran")
	require.Equal(t, 1, e.ledgerRows())
}

// The middleware composes with a chi-style chain and with net/http's own
// mux patterns; the route it reports is the pattern that matched.
func TestHTTPMiddlewareComposes(t *testing.T) {
	t.Parallel()
	db := suiteDB(t)
	var routes []string
	var mu sync.Mutex
	store := migratedStore(t, db, idempotency.WithTracer(endTracer(func(_ context.Context, data idempotency.TraceCallEndData) {
		mu.Lock()
		defer mu.Unlock()
		routes = append(routes, fmt.Sprintf("%s %v %d", data.Method, data.Outcome, data.HTTPStatus))
	})))
	idem := idempotency.HTTPMiddleware(store)
	auth := func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Header.Get("Authorization") == "" {
				http.Error(w, "who are you", http.StatusUnauthorized)
				return
			}
			next.ServeHTTP(w, r)
		})
	}
	chain := func(h http.Handler, mws ...func(http.Handler) http.Handler) http.Handler {
		for i := len(mws) - 1; i >= 0; i-- {
			h = mws[i](h)
		}
		return h
	}
	mux := http.NewServeMux()
	mux.Handle("POST /v1/accounts/{id}/charges", chain(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, err := idempotency.MustTxFromContext(r.Context()).Exec(r.Context(), `INSERT INTO ledger (note, key) VALUES ($1, 'k')`, r.PathValue("id"))
		require.NoError(t, err)
		_, _ = io.WriteString(w, "charged "+r.PathValue("id"))
	}), auth, idem))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	post := func(path, key string) (int, string) {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+path, strings.NewReader("x"))
		req.Header.Set(idempotency.HeaderKey, key)
		req.Header.Set("Authorization", "Bearer t")
		resp, err := srv.Client().Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	code, body := post("/v1/accounts/a1/charges", "k")
	require.Equal(t, http.StatusOK, code)
	require.Equal(t, "charged a1", body)
	code, body = post("/v1/accounts/a1/charges", "k")
	require.Equal(t, "charged a1", body)
	code, _ = post("/v1/accounts/a2/charges", "k")
	require.Equal(t, http.StatusUnprocessableEntity, code, "the same key for another path is another request")
	require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM ledger`))
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, []string{
		"POST /v1/accounts/{id}/charges executed 200",
		"POST /v1/accounts/{id}/charges replayed 200",
		"POST /v1/accounts/{id}/charges key_reused 422",
	}, routes)
}

// The HTTP middleware mounted as services mount it: with handlers that
// send trailers, informational responses and headers of their own
// spelling, on HTTP/1.1 and HTTP/2.

// It failed when trailers were kept with the headers: on HTTP/1.1 a
// trailer's value went out early as a header and no trailer arrived; on
// HTTP/2 the first response had it and the replay did not; trailers set
// with http.TrailerPrefix were dropped. Trailers are stored and replayed as
// headers are: those of the replayed list.
func TestHTTPTrailersAreSentAndReplayedAsTrailers(t *testing.T) {
	t.Parallel()
	store := migratedStore(t, suiteDB(t))
	var runs atomic.Int64
	handler := idempotency.HTTPMiddleware(store, idempotency.WithHTTPReplayedHeaders("X-Checksum", "X-Signature"))(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.Header().Set("Trailer", "X-Checksum, X-Timing")
		w.Header().Set("Content-Type", "text/plain")
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, "charged")
		w.Header().Set("X-Checksum", "sum-1")
		w.Header().Set("X-Timing", "12ms")
		w.Header().Set(http.TrailerPrefix+"X-Signature", "sig-1")
	}))
	for _, proto := range []string{"HTTP/1.1", "HTTP/2"} {
		t.Run(proto, func(t *testing.T) {
			srv := httptest.NewUnstartedServer(handler)
			if proto == "HTTP/2" {
				srv.EnableHTTP2 = true
				srv.StartTLS()
			} else {
				srv.Start()
			}
			t.Cleanup(srv.Close)
			key := "k-trailer-" + proto
			first := do(t, srv.Client(), mountedPost(t, srv.URL, "", "x"), key)
			require.Equal(t, http.StatusCreated, first.status)
			for _, name := range []string{"X-Checksum", "X-Timing", "X-Signature"} {
				require.Empty(t, first.header.Get(name), "%s went out as a header", name)
			}
			require.Equal(t, "sum-1", first.trailer.Get("X-Checksum"))
			require.Equal(t, "12ms", first.trailer.Get("X-Timing"))
			require.Equal(t, "sig-1", first.trailer.Get("X-Signature"))

			replay := do(t, srv.Client(), mountedPost(t, srv.URL, "", "x"), key)
			require.Equal(t, "true", replay.header.Get(idempotency.ReplayedHeader))
			require.Equal(t, "charged", replay.body)
			require.Equal(t, "sum-1", replay.trailer.Get("X-Checksum"))
			require.Equal(t, "sig-1", replay.trailer.Get("X-Signature"))
			require.Empty(t, replay.trailer.Get("X-Timing"), "not in the replayed list: the first response's alone")
			require.Empty(t, replay.header.Get("X-Checksum"))
		})
	}
	require.EqualValues(t, 2, runs.Load())
}

// It failed when the body read before the handler ran under the server's
// ReadTimeout alone: a handler that extended the read deadline for a slow
// upload did so too late, and the client got 400 "i/o timeout" for the
// server's own timeout. WithHTTPReadTimeout gives the read its time; a read
// that times out is 408.
func TestHTTPSlowUploadAndTheReadDeadline(t *testing.T) {
	t.Parallel()
	store := migratedStore(t, suiteDB(t))
	handler := func(w http.ResponseWriter, r *http.Request) {
		_ = http.NewResponseController(w).SetReadDeadline(time.Now().Add(time.Minute))
		b, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		_, _ = fmt.Fprintf(w, "got %d bytes", len(b))
	}
	serve := func(h http.Handler) *httptest.Server {
		srv := httptest.NewUnstartedServer(h)
		srv.Config.ReadTimeout = 300 * time.Millisecond
		srv.Start()
		t.Cleanup(srv.Close)
		return srv
	}
	slowPost := func(srv *httptest.Server, key string) mountedReply {
		pr, pw := io.Pipe()
		go func() {
			for range 8 {
				time.Sleep(100 * time.Millisecond)
				if _, err := pw.Write([]byte("0123456789")); err != nil {
					return
				}
			}
			_ = pw.Close()
		}()
		req, err := http.NewRequest(http.MethodPost, srv.URL, pr)
		require.NoError(t, err)
		req.ContentLength = 80
		return do(t, srv.Client(), req, key)
	}
	plain := serve(http.HandlerFunc(handler))
	require.Equal(t, http.StatusOK, slowPost(plain, "").status, "the handler alone takes the slow upload")

	given := serve(idempotency.HTTPMiddleware(store, idempotency.WithHTTPReadTimeout(time.Minute))(http.HandlerFunc(handler)))
	r := slowPost(given, "k-slow")
	require.Equal(t, http.StatusOK, r.status, r.body)
	require.Equal(t, "got 80 bytes", r.body)

	bare := serve(idempotency.HTTPMiddleware(store)(http.HandlerFunc(handler)))
	r = slowPost(bare, "k-slow-bare")
	require.Equal(t, http.StatusRequestTimeout, r.status, "the server's timeout is not the client's 400: %s", r.body)
	require.Contains(t, r.body, "WithHTTPReadTimeout")
}

// It failed when headers were stored and replayed by the names the handler
// used: one set as w.Header()["location"] went out with the first response
// and was missing from the replay.
func TestHTTPHeaderOfAnotherSpellingIsReplayed(t *testing.T) {
	t.Parallel()
	store := migratedStore(t, suiteDB(t))
	srv := httptest.NewServer(idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header()["location"] = []string{"/v1/charges/7"}
		w.Header()["content-type"] = []string{"application/json"}
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, `{"id":7}`)
	})))
	t.Cleanup(srv.Close)
	first := do(t, srv.Client(), mountedPost(t, srv.URL, "", "x"), "k-spelling")
	require.Equal(t, "/v1/charges/7", first.header.Get("Location"))
	replay := do(t, srv.Client(), mountedPost(t, srv.URL, "", "x"), "k-spelling")
	require.Equal(t, "true", replay.header.Get(idempotency.ReplayedHeader))
	require.Equal(t, "/v1/charges/7", replay.header.Get("Location"))
	require.Equal(t, "application/json", replay.header.Get("Content-Type"))
}

// It failed when the method stored with the key was "POST " and the path
// in full: a path of about 1,100 bytes got a 400 the handler would not
// give.
func TestHTTPLongPathIsServed(t *testing.T) {
	t.Parallel()
	store := migratedStore(t, suiteDB(t))
	var runs atomic.Int64
	mux := http.NewServeMux()
	mux.Handle("POST /v1/charges/", idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.WriteHeader(http.StatusCreated)
	})))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	long := srv.URL + "/v1/charges/" + strings.Repeat("p", 1100)
	require.Equal(t, http.StatusCreated, do(t, srv.Client(), mountedPost(t, long, "", "x"), "k-long").status)
	replay := do(t, srv.Client(), mountedPost(t, long, "", "x"), "k-long")
	require.Equal(t, http.StatusCreated, replay.status)
	require.Equal(t, "true", replay.header.Get(idempotency.ReplayedHeader))
	other := do(t, srv.Client(), mountedPost(t, long+"q", "", "x"), "k-long")
	require.Equal(t, http.StatusUnprocessableEntity, other.status, "another long path is another request")
	require.EqualValues(t, 1, runs.Load())
}

// It failed when the recorder kept 1xx responses to itself: a 103 Early
// Hints never reached the client, and WriteHeader(101) was stored and
// replayed as 200. A 1xx other than 101 goes out at once, unstored; 101 is
// a final status.
func TestHTTPInformationalResponses(t *testing.T) {
	t.Parallel()
	store := migratedStore(t, suiteDB(t))
	srv := httptest.NewServer(idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Link", "</style.css>; rel=preload")
		w.WriteHeader(http.StatusEarlyHints)
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, "charged")
	})))
	t.Cleanup(srv.Close)
	hints := func() (got []int) {
		req := mountedPost(t, srv.URL, "", "x")
		req = req.WithContext(httptrace.WithClientTrace(req.Context(), &httptrace.ClientTrace{
			Got1xxResponse: func(code int, header textproto.MIMEHeader) error {
				got = append(got, code)
				require.Equal(t, "</style.css>; rel=preload", header.Get("Link"))
				return nil
			},
		}))
		r := do(t, srv.Client(), req, "k-hints")
		require.Equal(t, http.StatusCreated, r.status)
		require.Equal(t, "charged", r.body)
		return got
	}
	require.Equal(t, []int{http.StatusEarlyHints}, hints(), "the 103 reaches the client")
	require.Empty(t, hints(), "a replay has no 1xx: they are not stored")

	switching := idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusSwitchingProtocols)
	}))
	for _, replayed := range []string{"", "true"} {
		rec := httptest.NewRecorder()
		req := httptest.NewRequestWithContext(context.Background(), http.MethodPost, "/upgrade", strings.NewReader("x"))
		req.Header.Set(idempotency.HeaderKey, "k-101")
		switching.ServeHTTP(rec, req)
		require.Equal(t, http.StatusSwitchingProtocols, rec.Code, "101 is final, stored and replayed as such")
		require.Equal(t, replayed, rec.Header().Get(idempotency.ReplayedHeader))
	}
}

// It failed when the body was read before the scope was asked: a caller
// the scope refused cost a read of up to 1 MiB, and a client that sent
// "Expect: 100-continue" was told to send its body.
func TestHTTPScopeIsAskedBeforeTheBodyIsRead(t *testing.T) {
	t.Parallel()
	store := migratedStore(t, suiteDB(t))
	var read atomic.Int64
	counting := func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			r.Body = &countingBody{r.Body, &read}
			next.ServeHTTP(w, r)
		})
	}
	refuse := idempotency.WithHTTPScope(func(r *http.Request) (string, error) {
		return "", fmt.Errorf("no caller")
	})
	srv := httptest.NewServer(counting(idempotency.HTTPMiddleware(store, refuse)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		t.Error("the handler ran for a refused caller")
	}))))
	t.Cleanup(srv.Close)
	req := mountedPost(t, srv.URL, "", strings.Repeat("x", 64<<10))
	req.Header.Set("Expect", "100-continue")
	r := do(t, srv.Client(), req, "k-refused")
	require.Equal(t, http.StatusUnauthorized, r.status, r.body)
	require.Zero(t, read.Load(), "no byte of the body was read")
}

type countingBody struct {
	io.ReadCloser
	n *atomic.Int64
}

func (b *countingBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	b.n.Add(int64(n))
	return n, err
}

// It failed when the headers stored with an HTTP response had no bound
// (MaxStoredMetadata bounded gRPC's alone): a handler's 64 KiB Location was
// stored with every key. Over the bound the request fails with 500, its
// writes rolled back and nothing stored, as on the gRPC side.
func TestHTTPStoredHeadersAreBounded(t *testing.T) {
	t.Parallel()
	big := newHTTPEnv(t, func(w http.ResponseWriter, r *http.Request) {
		_, err := idempotency.MustTxFromContext(r.Context()).Exec(r.Context(), `INSERT INTO ledger (note, key) VALUES ('big', 'k-big')`)
		require.NoError(t, err)
		w.Header().Set("Location", "/v1/charges/"+strings.Repeat("l", idempotency.MaxStoredMetadata))
		w.WriteHeader(http.StatusCreated)
	})
	r := big.post("k-big", "x")
	require.Equal(t, http.StatusInternalServerError, r.status, r.body)
	require.Contains(t, r.body, "MaxStoredMetadata")
	require.Zero(t, big.db.Count(t, `SELECT count(*) FROM ledger WHERE key = 'k-big'`), "the writes rolled back")
	r = big.post("k-big", "x")
	require.Equal(t, http.StatusInternalServerError, r.status, "nothing was stored: the retry runs again")
	require.EqualValues(t, 2, big.runs.Load())
}

// It failed when the headers a 1xx response carried stayed in the real
// writer's map: a header the handler set for the 103 and then removed went
// out with the first final response (net/http would not send it) and not
// with the replay, so the first caller and the retry got different
// replayed headers.
func TestHTTPEarlyHintsHeadersDoNotLeakIntoTheFinalResponse(t *testing.T) {
	t.Parallel()
	store := migratedStore(t, suiteDB(t))
	srv := httptest.NewServer(idempotency.HTTPMiddleware(store, idempotency.WithHTTPReplayedHeaders("Link"))(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Link", "</style.css>; rel=preload")
		w.WriteHeader(http.StatusEarlyHints)
		w.Header().Del("Link") // for the hint only
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, "charged")
	})))
	t.Cleanup(srv.Close)
	send := func() (mountedReply, []int) {
		var hints []int
		req := mountedPost(t, srv.URL, "", "x")
		req = req.WithContext(httptrace.WithClientTrace(req.Context(), &httptrace.ClientTrace{
			Got1xxResponse: func(code int, _ textproto.MIMEHeader) error { hints = append(hints, code); return nil },
		}))
		return do(t, srv.Client(), req, "k-hint-leak"), hints
	}
	first, hints := send()
	require.Equal(t, []int{http.StatusEarlyHints}, hints)
	require.Equal(t, http.StatusCreated, first.status)
	require.Empty(t, first.header.Values("Link"), "the handler removed Link before its final status; net/http would not send it")
	replay, _ := send()
	require.Equal(t, "true", replay.header.Get(idempotency.ReplayedHeader))
	require.Equal(t, first.header.Values("Link"), replay.header.Values("Link"), "the first caller and the retry get different replayed headers")
}

// An HTTP response compressed by the handler replays with its
// Content-Encoding, readable; a cookie it set is neither replayed nor
// stored.
func TestHTTPReplayKeepsContentEncodingAndNoCookie(t *testing.T) {
	t.Parallel()
	var compressed bytes.Buffer
	zw := gzip.NewWriter(&compressed)
	_, _ = zw.Write([]byte(`{"charged":true}`))
	require.NoError(t, zw.Close())
	e := newHTTPEnv(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Encoding", "gzip")
		http.SetCookie(w, &http.Cookie{Name: "session", Value: "first-callers-secret"})
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write(compressed.Bytes())
	})
	for i := 0; i < 2; i++ {
		req, err := http.NewRequest(http.MethodPost, e.srv.URL+"/v1/charges", strings.NewReader("x"))
		require.NoError(t, err)
		req.Header.Set(idempotency.HeaderKey, "k")
		resp, err := e.srv.Client().Do(req) // decompresses what says gzip
		require.NoError(t, err)
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.NoError(t, err)
		require.Equal(t, `{"charged":true}`, string(body), "attempt %d", i)
		require.Equal(t, i == 1, resp.Header.Get(idempotency.ReplayedHeader) == "true")
		if i == 1 {
			require.Empty(t, resp.Cookies(), "the first caller's cookie is not replayed")
		}
	}
	require.EqualValues(t, 1, e.runs.Load())
	rec, err := e.store.Inspect(context.Background(), "", "k")
	require.NoError(t, err)
	require.NotContains(t, string(rec.Metadata), "first-callers-secret", "nor stored")
}

// The HTTP middleware stores a handler's final answer as a response (its
// status, headers and body), and an error of the engine's as a problem
// document: the first caller and every replay get the same bytes.
func TestFinalHTTPAnswersEveryCallerAlike(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		handler http.HandlerFunc
		code    int
	}{
		{name: "the handler's own 4xx", code: http.StatusPaymentRequired, handler: func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			w.Header().Set("X-Decline-Code", "insufficient_funds")
			w.WriteHeader(http.StatusPaymentRequired)
			_, _ = io.WriteString(w, `{"error":"card declined"}`)
		}},
		{name: "an error of the engine's, stored", code: http.StatusInternalServerError, handler: func(w http.ResponseWriter, r *http.Request) {
			tx := idempotency.MustTxFromContext(r.Context())
			_, _ = tx.Exec(r.Context(), `COMMIT`) // refused, and the call fails, stored
			w.WriteHeader(http.StatusCreated)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			store := migratedStore(t, testdb.New(t, 4))
			var runs atomic.Int64
			srv := httptest.NewServer(idempotency.HTTPMiddleware(store, idempotency.WithHTTPReplayedHeaders("X-Decline-Code"))(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				runs.Add(1)
				tc.handler(w, r)
			})))
			t.Cleanup(srv.Close)
			send := func() (int, http.Header, []byte) {
				req, err := http.NewRequest(http.MethodPost, srv.URL+"/v1/charges", strings.NewReader(`{"amount":1}`))
				require.NoError(t, err)
				req.Header.Set(idempotency.HeaderKey, "k")
				resp, err := http.DefaultClient.Do(req)
				require.NoError(t, err)
				defer resp.Body.Close()
				body, err := io.ReadAll(resp.Body)
				require.NoError(t, err)
				h := resp.Header.Clone()
				h.Del("Date")
				return resp.StatusCode, h, body
			}
			code1, h1, body1 := send()
			code2, h2, body2 := send()
			require.Equal(t, tc.code, code1, "%s", body1)
			require.Equal(t, code1, code2)
			require.Equal(t, string(body1), string(body2), "the replay's body is the first's")
			require.Equal(t, []string{"true"}, h2.Values(idempotency.ReplayedHeader), "the replay says so")
			h2.Del(idempotency.ReplayedHeader)
			keys := func(h http.Header) []string {
				k := slices.Collect(func(yield func(string) bool) {
					for name := range h {
						if !yield(name) {
							return
						}
					}
				})
				slices.Sort(k)
				return k
			}
			require.Equal(t, keys(h1), keys(h2))
			require.Equal(t, h1, h2, "the replay's headers are the first's")
			require.EqualValues(t, 1, runs.Load())
		})
	}
}
