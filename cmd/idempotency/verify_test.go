package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/reflection"

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
		if tx, ok := idempotency.TxFromContext(r.Context()); ok && variant != "pool" {
			err = tx.QueryRow(r.Context(), `INSERT INTO transfers (amount) VALUES ($1) RETURNING id`, req.Amount).Scan(&id)
		} else {
			err = db.Pool.QueryRow(r.Context(), `INSERT INTO transfers (amount) VALUES ($1) RETURNING id`, req.Amount).Scan(&id)
			time.Sleep(200 * time.Millisecond) // the handler goes on working after its write
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
