package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/reflection"
	"google.golang.org/grpc/status"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
	testingv1 "github.com/exactlyonce/idempotency/internal/testpb/idempotency/testing/v1"
)

// verifyService is an HTTP service of transfers on db, as a user would
// build it (variant "good"), or broken in one way: "pool" writes with the
// pool instead of the call's transaction, "plain" has no middleware,
// "drop-key" sits behind a proxy that drops the Idempotency-Key header,
// "shared-scope" keys every caller in one scope.
func verifyService(t *testing.T, db *testdb.DB, variant string) string {
	t.Helper()
	ctx := context.Background()
	store, err := idempotency.NewStore(db.Pool)
	require.NoError(t, err)
	require.NoError(t, store.Migrate(ctx))
	_, err = db.Pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS transfers (id bigserial PRIMARY KEY, amount bigint NOT NULL)`)
	require.NoError(t, err)
	transfer := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var req struct{ Amount int64 }
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		var id int64
		var err error
		if tx, ok := idempotency.TxFromContext(r.Context()); ok && variant != "pool" {
			err = tx.QueryRow(r.Context(), `INSERT INTO transfers (amount) VALUES ($1) RETURNING id`, req.Amount).Scan(&id)
		} else {
			err = db.Pool.QueryRow(r.Context(), `INSERT INTO transfers (amount) VALUES ($1) RETURNING id`, req.Amount).Scan(&id)
			time.Sleep(500 * time.Millisecond) // the handler goes on working after its write
		}
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		fmt.Fprintf(w, `{"id":%d,"amount":%d}`, id, req.Amount)
	})
	scope := idempotency.WithHTTPScope(func(r *http.Request) (string, error) { return r.Header.Get("X-Caller"), nil })
	if variant == "shared-scope" {
		scope = idempotency.WithHTTPScope(func(*http.Request) (string, error) { return "", nil })
	}
	var h http.Handler = idempotency.HTTPMiddleware(store, scope)(transfer)
	if variant == "plain" {
		h = transfer
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	if variant == "drop-key" {
		u, _ := url.Parse(srv.URL)
		proxy := httputil.NewSingleHostReverseProxy(u)
		direct := proxy.Director
		proxy.Director = func(r *http.Request) { direct(r); r.Header.Del(idempotency.HeaderKey) }
		front := httptest.NewServer(proxy)
		t.Cleanup(front.Close)
		return front.URL
	}
	return srv.URL
}

// verifyOut runs the verify command against url, with -json, and returns
// its exit status and checks by name.
func verifyOut(t *testing.T, db *testdb.DB, url string, extra ...string) (int, map[string]checkResult, string) {
	t.Helper()
	args := append([]string{"-database-url", db.URL(), "verify", "-json", "-http", url, "-d", `{"amount":100}`,
		"-H", "X-Caller: alice", "-H2", "X-Caller: bob", "-effect-sql", "select count(*) from transfers", "-key-policy", "required"}, extra...)
	var out, errOut bytes.Buffer
	code := run(context.Background(), args, &out, &errOut)
	var report struct {
		Passed bool
		Checks []checkResult
	}
	require.NoError(t, json.Unmarshal(out.Bytes(), &report), "stdout %s\nstderr %s", out.String(), errOut.String())
	checks := map[string]checkResult{}
	for _, c := range report.Checks {
		checks[c.Check] = c
	}
	return code, checks, out.String()
}

// verify passes against a service built right, and fails, naming the
// check, against each way of building it wrong.
func TestVerifyPassesAServiceBuiltRightAndNamesWhatIsWrong(t *testing.T) {
	t.Parallel()
	for variant, fails := range map[string]string{
		"good":         "",
		"pool":         "effect once",
		"plain":        "lost reply",
		"drop-key":     "lost reply",
		"shared-scope": "callers apart",
	} {
		t.Run(variant, func(t *testing.T) {
			t.Parallel()
			db := testdb.New(t, 8)
			code, checks, out := verifyOut(t, db, verifyService(t, db, variant))
			if fails == "" {
				require.Equal(t, 0, code, out)
				for name, c := range checks {
					require.Equal(t, "PASS", c.Result, "%s: %s", name, out)
				}
				require.Len(t, checks, 7, out)
				return
			}
			require.Equal(t, 1, code, out)
			require.Equal(t, "FAIL", checks[fails].Result, out)
		})
	}
}

// The table, for a terminal: every check a row, and a verdict.
func TestVerifyPrintsATable(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 8)
	target := verifyService(t, db, "good")
	var out, errOut bytes.Buffer
	code := run(context.Background(), []string{"-database-url", db.URL(), "verify", "-http", target, "-d", `{"amount":1}`,
		"-effect-sql", "select count(*) from transfers"}, &out, &errOut)
	require.Equal(t, 0, code, out.String()+errOut.String())
	t.Log("\n" + out.String())
	for _, want := range []string{"CHECK", "lost reply", "duplicates", "in flight", "key reused", "no key", "effect once", "verdict: PASS"} {
		require.Contains(t, out.String(), want)
	}
}

// A target off loopback and private networks is refused unless asked.
func TestVerifyRefusesARemoteTarget(t *testing.T) {
	t.Parallel()
	var out, errOut bytes.Buffer
	code := run(context.Background(), []string{"verify", "-http", "http://8.8.8.8/charges", "-d", "{}"}, &out, &errOut)
	require.Equal(t, 2, code)
	require.Contains(t, errOut.String(), "-allow-remote")
}

// transferService is a gRPC PolicyService whose Required method writes a
// transfer through the call's transaction, with server reflection.
type transferService struct {
	testingv1.UnimplementedPolicyServiceServer
	db *testdb.DB
}

func (s transferService) Required(ctx context.Context, req *testingv1.Request) (*testingv1.Response, error) {
	var q interface {
		QueryRow(context.Context, string, ...any) pgx.Row
	} = s.db.Pool // without the interceptor, a plain handler
	if tx, ok := idempotency.TxFromContext(ctx); ok {
		q = tx
	}
	var id int64
	err := q.QueryRow(ctx, `INSERT INTO transfers (amount) VALUES ($1) RETURNING id`, req.GetAmount()).Scan(&id)
	return &testingv1.Response{Body: req.GetBody(), LedgerId: id}, err
}

// verify over gRPC, the method's descriptors by reflection: it passes a
// server with the interceptor, and fails one without it.
func TestVerifyOverGRPC(t *testing.T) {
	t.Parallel()
	for _, intercepted := range []bool{true, false} {
		t.Run(fmt.Sprint("intercepted=", intercepted), func(t *testing.T) {
			t.Parallel()
			db := testdb.New(t, 8)
			store, err := idempotency.NewStore(db.Pool)
			require.NoError(t, err)
			require.NoError(t, store.Migrate(context.Background()))
			_, err = db.Pool.Exec(context.Background(), `CREATE TABLE transfers (id bigserial PRIMARY KEY, amount bigint NOT NULL)`)
			require.NoError(t, err)
			var opts []grpc.ServerOption
			if intercepted {
				opts = append(opts, grpc.UnaryInterceptor(idempotency.UnaryServerInterceptor(store)))
			}
			srv := grpc.NewServer(opts...)
			testingv1.RegisterPolicyServiceServer(srv, transferService{db: db})
			reflection.Register(srv)
			lis, err := net.Listen("tcp", "127.0.0.1:0")
			require.NoError(t, err)
			go func() { _ = srv.Serve(lis) }()
			t.Cleanup(srv.Stop)
			var out, errOut bytes.Buffer
			code := run(context.Background(), []string{"-database-url", db.URL(), "verify", "-grpc", lis.Addr().String(),
				"-method", "/idempotency.testing.v1.PolicyService/Required", "-request", `{"body":"transfer","amount":"100"}`,
				"-effect-sql", "select count(*) from transfers", "-key-policy", "required"}, &out, &errOut)
			if intercepted {
				require.Equal(t, 0, code, out.String()+errOut.String())
				t.Log("\n" + out.String())
			} else {
				require.Equal(t, 1, code, out.String()+errOut.String())
				require.Contains(t, out.String(), "lost reply: ")
			}
		})
	}
}

// verifyRun runs the command with -json and returns code, checks, stdout, stderr.
func verifyRun(t *testing.T, args ...string) (int, map[string]checkResult, string, string) {
	t.Helper()
	var out, errOut bytes.Buffer
	code := run(context.Background(), args, &out, &errOut)
	checks := map[string]checkResult{}
	var report struct{ Checks []checkResult }
	if json.Unmarshal(out.Bytes(), &report) == nil {
		for _, c := range report.Checks {
			checks[c.Check] = c
		}
	}
	return code, checks, out.String(), errOut.String()
}

// verifyStore is a migrated store on a fresh database with a transfers table.
func verifyStore(t *testing.T, maxConns int32, opts ...idempotency.StoreOption) (*testdb.DB, *idempotency.Store) {
	t.Helper()
	db := testdb.New(t, maxConns)
	store, err := idempotency.NewStore(db.Pool, opts...)
	require.NoError(t, err)
	require.NoError(t, store.Migrate(context.Background()))
	_, err = db.Pool.Exec(context.Background(), `CREATE TABLE IF NOT EXISTS transfers (id bigserial PRIMARY KEY, amount bigint NOT NULL)`)
	require.NoError(t, err)
	return db, store
}

func insertTransfer(t *testing.T, db *testdb.DB, r *http.Request, viaPool bool) (int64, error) {
	var id int64
	if tx, ok := idempotency.TxFromContext(r.Context()); ok && !viaPool {
		err := tx.QueryRow(r.Context(), `INSERT INTO transfers (amount) VALUES (1) RETURNING id`).Scan(&id)
		return id, err
	}
	err := db.Pool.QueryRow(r.Context(), `INSERT INTO transfers (amount) VALUES (1) RETURNING id`).Scan(&id)
	return id, err
}

// A correct service whose final answer is a 409 (the library itself maps a
// handler's FailedPrecondition to a stored, replayed 409 "Conflict").
func TestVerifyTakesAStoredConflictForTheServicesAnswer(t *testing.T) {
	t.Parallel()
	db, store := verifyStore(t, 8)
	h := idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusConflict)
		fmt.Fprint(w, `{"error":"account frozen"}`)
	}))
	srv := httptest.NewServer(h)
	defer srv.Close()
	start := time.Now()
	code, checks, out, errOut := verifyRun(t, "-database-url", db.URL(), "verify", "-json", "-timeout", "2s",
		"-http", srv.URL, "-d", `{"amount":1}`, "-key-policy", "required")
	t.Logf("took %s\n%s%s", time.Since(start), out, errOut)
	require.Equal(t, "PASS", checks["lost reply"].Result, out)
	require.Equal(t, 0, code, out)
}

// Same via gRPC: a handler's final FailedPrecondition (the library stores
// and replays it) is taken for "key reused".
type frozenService struct {
	testingv1.UnimplementedPolicyServiceServer
}

func (frozenService) Required(context.Context, *testingv1.Request) (*testingv1.Response, error) {
	return nil, status.Error(codes.FailedPrecondition, "account frozen")
}

func TestVerifyTakesAStoredFailedPreconditionForTheServicesAnswer(t *testing.T) {
	t.Parallel()
	db, store := verifyStore(t, 8)
	srv := grpc.NewServer(grpc.UnaryInterceptor(idempotency.UnaryServerInterceptor(store)))
	testingv1.RegisterPolicyServiceServer(srv, frozenService{})
	reflection.Register(srv)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	go func() { _ = srv.Serve(lis) }()
	defer srv.Stop()
	code, checks, out, errOut := verifyRun(t, "-database-url", db.URL(), "verify", "-json", "-timeout", "2s", "-grpc", lis.Addr().String(),
		"-method", "/idempotency.testing.v1.PolicyService/Required", "-request", `{"body":"transfer","amount":"100"}`, "-key-policy", "required")
	t.Log(out, errOut)
	require.Equal(t, "PASS", checks["lost reply"].Result, out)
	require.Equal(t, 0, code, out)
}

// A correct service, callers scoped apart, whose answer does not carry an
// id (same bytes for every execution): callers apart fails it.
func TestVerifyCallersApartWithTheSameBytesForEveryCaller(t *testing.T) {
	t.Parallel()
	db, store := verifyStore(t, 8)
	scope := idempotency.WithHTTPScope(func(r *http.Request) (string, error) { return r.Header.Get("X-Caller"), nil })
	h := idempotency.HTTPMiddleware(store, scope)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, err := insertTransfer(t, db, r, false); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, `{"status":"accepted"}`)
	}))
	srv := httptest.NewServer(h)
	defer srv.Close()
	code, checks, out := verifyOut(t, db, srv.URL)
	require.Equal(t, "PASS", checks["callers apart"].Result, out)
	require.Equal(t, 0, code, out)
}

// The test's own "pool" variant (write, then 200ms of work), its store's
// key table in another schema; the user did not give -schema. The probe of
// the key table errors on every poll, silently.
func TestVerifyRefusesAKeyTableThatIsNotThere(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 8)
	other := pgx.Identifier{db.Schema + "_app"}.Sanitize()
	_, err := db.Pool.Exec(context.Background(), `CREATE SCHEMA `+other)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = db.Pool.Exec(context.Background(), `DROP SCHEMA `+other+` CASCADE`) })
	store, err := idempotency.NewStore(db.Pool, idempotency.WithTable(db.Schema+"_app", "keys"))
	require.NoError(t, err)
	require.NoError(t, store.Migrate(context.Background()))
	_, err = db.Pool.Exec(context.Background(), `CREATE TABLE transfers (id bigserial PRIMARY KEY, amount bigint NOT NULL)`)
	require.NoError(t, err)
	scope := idempotency.WithHTTPScope(func(r *http.Request) (string, error) { return r.Header.Get("X-Caller"), nil })
	h := idempotency.HTTPMiddleware(store, scope)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		id, err := insertTransfer(t, db, r, true)
		time.Sleep(200 * time.Millisecond)
		if err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		fmt.Fprintf(w, `{"id":%d}`, id)
	}))
	srv := httptest.NewServer(h)
	defer srv.Close()
	code, _, out, errOut := verifyRun(t, "-database-url", db.URL(), "verify", "-json", "-http", srv.URL, "-d", `{"amount":100}`,
		"-effect-sql", "select count(*) from transfers")
	require.Equal(t, 2, code, out+errOut)
	require.Contains(t, errOut, "give -schema and -table")
}

// A server with no idempotency at all, a deterministic body, and strict
// validation answering 422 to an unknown member (FastAPI, Rails style).
func TestVerifyFailsAServiceWithoutKeysThatRefusesTheOtherBody(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		dec := json.NewDecoder(r.Body)
		dec.DisallowUnknownFields()
		var req struct{ Amount int64 }
		if err := dec.Decode(&req); err != nil {
			http.Error(w, `{"detail":"`+err.Error()+`"}`, http.StatusUnprocessableEntity)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, `{"status":"accepted"}`)
	}))
	defer srv.Close()
	code, _, out, errOut := verifyRun(t, "verify", "-json", "-http", srv.URL, "-d", `{"amount":1}`, "-key-policy", "optional")
	t.Log(out, errOut)
	require.NotEqual(t, 0, code, "a server without idempotency passed:\n%s", out)
}

// A local target that redirects elsewhere: the tool follows the redirect
// off loopback without -allow-remote.
func TestVerifyDoesNotFollowARedirect(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, "http://8.8.8.8:9/charges", http.StatusTemporaryRedirect)
	}))
	defer srv.Close()
	code, _, out, errOut := verifyRun(t, "verify", "-json", "-timeout", "1s", "-http", srv.URL, "-d", `{"amount":1}`)
	t.Log(code, out, errOut)
	// The local server only ever answers 307; any other status came from
	// the host the redirect named, which the tool reached without -allow-remote.
	require.NotContains(t, out, `"came_back": "404`, "the tool followed the redirect to 8.8.8.8:9 and got its answer")
}

// A URL with credentials: they are printed in the report.
func TestVerifyDoesNotPrintTheURLsPassword(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { fmt.Fprint(w, "ok") }))
	defer srv.Close()
	u := strings.Replace(srv.URL, "http://", "http://user:s3cret@", 1)
	_, _, out, errOut := verifyRun(t, "verify", "-http", u, "-d", `{"amount":1}`)
	require.NotContains(t, out+errOut, "s3cret", out)
}

// A server whose concurrent duplicates deadlock (neither the first nor its
// duplicates are ever answered); lost replies, a reused key and a missing
// key are handled right. Transport errors are classed "answered" with equal
// (empty) bodies, so duplicates and in flight pass.
func TestVerifyFailsDuplicatesThatGetNoAnswer(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	type rec struct{ body, resp string }
	done := map[string]rec{}
	inflight := map[string]int{}
	n := 0
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get("Idempotency-Key")
		b, _ := io.ReadAll(r.Body)
		if key == "" {
			http.Error(w, "missing Idempotency-Key", http.StatusBadRequest)
			return
		}
		mu.Lock()
		if d, ok := done[key]; ok {
			mu.Unlock()
			if d.body != string(b) {
				http.Error(w, "key reused", http.StatusUnprocessableEntity)
				return
			}
			w.Header().Set(idempotency.ReplayedHeader, "true")
			fmt.Fprint(w, d.resp)
			return
		}
		inflight[key]++
		if inflight[key] > 1 {
			mu.Unlock()
			<-r.Context().Done() // deadlock
			return
		}
		n++
		resp := fmt.Sprintf(`{"id":%d}`, n)
		mu.Unlock()
		time.Sleep(100 * time.Millisecond)
		mu.Lock()
		contended := inflight[key] > 1
		mu.Unlock()
		if contended {
			<-r.Context().Done() // deadlock
			return
		}
		mu.Lock()
		done[key] = rec{string(b), resp}
		mu.Unlock()
		fmt.Fprint(w, resp)
	}))
	defer srv.Close()
	code, checks, out, errOut := verifyRun(t, "verify", "-json", "-timeout", "2s", "-http", srv.URL, "-d", `{"amount":1}`, "-key-policy", "required")
	t.Log(out, errOut)
	require.NotEqual(t, "PASS", checks["duplicates"].Result, out)
	require.NotEqual(t, 0, code, out)
}
