package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// storedHTTPMetadata encodes an HTTP response's status, headers and
// trailers as the middleware stores them (field 1 the status, 2 each
// header, 3 each trailer: a name, then its values).
func storedHTTPMetadata(status int, header, trailer [][]string) []byte {
	b := protowire.AppendVarint(protowire.AppendTag(nil, 1, protowire.VarintType), uint64(status))
	for _, part := range []struct {
		num     protowire.Number
		entries [][]string
	}{{2, header}, {3, trailer}} {
		for _, e := range part.entries {
			entry := protowire.AppendString(protowire.AppendTag(nil, 1, protowire.BytesType), e[0])
			for _, v := range e[1:] {
				entry = protowire.AppendString(protowire.AppendTag(entry, 2, protowire.BytesType), v)
			}
			b = protowire.AppendBytes(protowire.AppendTag(b, part.num, protowire.BytesType), entry)
		}
	}
	return b
}

// A record the middleware's first version stored, with the response's
// Set-Cookie and WWW-Authenticate among its headers: Inspect shows the
// headers a replay sends, which are none of those, and the same as the
// replay's.
func TestInspectShowsNoHeaderAReplayOmits(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 2)
	store := migratedStore(t, db)
	ctx := context.Background()
	h := idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, `{"id":"ch_1"}`)
	}))
	send := func() *httptest.ResponseRecorder {
		req := httptest.NewRequest(http.MethodPost, "/v1/charges", strings.NewReader(`{"amount":100}`))
		req.Header.Set(idempotency.HeaderKey, "order-1")
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		return rec
	}
	require.Equal(t, http.StatusCreated, send().Code)
	// What the first version stored: every header, cookies included.
	_, err := db.Pool.Exec(ctx, `UPDATE idempotency_keys SET metadata = $1 WHERE key = 'http order-1'`, storedHTTPMetadata(http.StatusCreated,
		[][]string{{"Content-Type", "application/json"}, {"Location", "/v1/charges/ch_1"}, {"Set-Cookie", "session=first-caller; HttpOnly"},
			{"Www-Authenticate", `Bearer realm="first"`}},
		[][]string{{"Set-Cookie", "late=first-caller"}}))
	require.NoError(t, err)

	rec, err := store.Inspect(ctx, "", "order-1")
	require.NoError(t, err)
	resp := rec.HTTPResponse()
	require.NotNil(t, resp)
	require.Equal(t, http.StatusCreated, resp.StatusCode)
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	require.Equal(t, `{"id":"ch_1"}`, string(body))
	header := resp.Header
	require.Equal(t, http.Header{"Content-Type": {"application/json"}, "Location": {"/v1/charges/ch_1"}}, header)
	require.Empty(t, resp.Trailer, "a trailer no replay sends")

	replay := send()
	require.Equal(t, "true", replay.Header().Get(idempotency.ReplayedHeader))
	require.Empty(t, replay.Result().Cookies(), "the replay sends no cookie")
	sent := replay.Header().Clone()
	sent.Del(idempotency.ReplayedHeader)
	sent.Del("Content-Length")
	require.Equal(t, header, sent, "Inspect's headers are the replay's")
}

// keyRows inserts n finished keys of scope, keys k-000001... created an
// hour ago, with the given state and method.
func keyRows(t *testing.T, db *testdb.DB, scope string, n int, state, method string) {
	t.Helper()
	_, err := db.Pool.Exec(context.Background(), `INSERT INTO idempotency_keys (scope, key, method, fingerprint, state, created_at, expires_at)
SELECT $1::text, 'k-' || lpad(i::text, 6, '0'), $4::text, '\x00', $3::text, now() - interval '1 hour', now() + interval '1 day'
FROM generate_series(1, $2::int) i`, scope, n, state, method)
	require.NoError(t, err)
}

// listStatements is a pgx tracer that keeps the SQL and arguments of
// List's statements.
type listStatements struct {
	mu    sync.Mutex
	calls []pgx.TraceQueryStartData
}

func (l *listStatements) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	if strings.Contains(data.SQL, "AS match") {
		l.mu.Lock()
		l.calls = append(l.calls, data)
		l.mu.Unlock()
	}
	return ctx
}

func (l *listStatements) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// List stays fast however large the table: each of its statements is a
// range of the primary key's index, a thousand rows at most, in the plan
// PostgreSQL keeps for a prepared statement as in the first one, and a
// filter that matches nothing reads Examine rows, not the table. Here on
// 200,000 keys, with a filter nothing matches.
func TestListReadsBoundedRangesOfThePrimaryKey(t *testing.T) {
	t.Parallel()
	traced := &listStatements{}
	db := testdb.NewConfigured(t, func(cfg *pgxpool.Config) { cfg.MaxConns = 2; cfg.ConnConfig.Tracer = traced })
	store := migratedStore(t, db)
	ctx := context.Background()
	keyRows(t, db, "big", 150000, "succeeded", "/pay.v1.Payments/Charge")
	keyRows(t, db, "small", 50000, "succeeded", "/pay.v1.Payments/Charge")
	_, err := db.Pool.Exec(ctx, `ANALYZE idempotency_keys`)
	require.NoError(t, err)

	for _, f := range []idempotency.ListFilter{
		{AnyScope: true, State: "failed", Examine: 5000},
		{Scope: "small", State: "failed", Examine: 5000},
	} {
		traced.calls = nil
		page, err := store.List(ctx, f)
		require.NoError(t, err)
		require.Empty(t, page.Records)
		require.Equal(t, 5000, page.Examined, "Examine rows read, not the table's 200,000")
		require.NotEmpty(t, page.Next)
		require.Len(t, traced.calls, 5, "five statements of a thousand rows")
		for _, mode := range []string{"force_custom_plan", "force_generic_plan"} {
			plan := explain(t, db, mode, traced.calls[2])
			require.Contains(t, plan, `"Index Name": "idempotency_keys_pkey"`, mode)
			require.NotContains(t, plan, "Seq Scan", mode)
			require.Contains(t, plan, `"Actual Rows": 1000,`, mode)
		}
	}
}

// explain returns the JSON plan, executed, of a traced statement, in the
// plan_cache_mode mode.
func explain(t *testing.T, db *testdb.DB, mode string, call pgx.TraceQueryStartData) string {
	t.Helper()
	ctx := context.Background()
	conn, err := db.Pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	_, err = conn.Exec(ctx, "SET plan_cache_mode = "+mode)
	require.NoError(t, err)
	_, err = conn.Exec(ctx, "PREPARE listing AS "+call.SQL)
	require.NoError(t, err)
	// EXPLAIN takes no parameters: the arguments are written as literals.
	literals := make([]string, len(call.Args))
	for i, arg := range call.Args {
		v := reflect.ValueOf(arg)
		if v.Kind() == reflect.Pointer {
			if v.IsNil() {
				literals[i] = "NULL"
				continue
			}
			v = v.Elem()
		}
		if v.Kind() == reflect.String {
			literals[i] = "'" + strings.ReplaceAll(v.String(), "'", "''") + "'"
		} else {
			literals[i] = strconv.FormatInt(v.Int(), 10)
		}
	}
	var plan string
	require.NoError(t, conn.QueryRow(ctx, "EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE listing("+strings.Join(literals, ", ")+")").Scan(&plan))
	_, err = conn.Exec(ctx, "DEALLOCATE listing; RESET plan_cache_mode")
	require.NoError(t, err)
	return plan
}

// List with a Key finds it in every scope that holds it, in every
// transport's namespace or in the one it names, page by page: Limit bounds
// the records, Examine the scopes a page steps through, and a page's Next
// goes on where it stopped, so that the pages together are the listing.
func TestListFindsAKeyInEveryScope(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 2)
	store := migratedStore(t, db)
	ctx := context.Background()
	for _, scope := range []string{"e", "d", "c", "b", "a"} {
		keyRows(t, db, scope, 3, "succeeded", "m")
	}
	_, err := db.Pool.Exec(ctx, `UPDATE idempotency_keys SET key = 'http k-000001' WHERE scope = 'c' AND key = 'k-000001';
DELETE FROM idempotency_keys WHERE scope = 'b' AND key = 'k-000001';
INSERT INTO idempotency_keys (scope, key, method, fingerprint, state, expires_at) VALUES ('d', 'message k-000001', 'idempotency/message', '\x00', 'failed', now() + interval '1 day')`)
	require.NoError(t, err)
	found := func(records []idempotency.Record) []string {
		var out []string
		for _, r := range records {
			require.Equal(t, "k-000001", r.Key)
			out = append(out, r.Scope+"/"+string(r.Transport))
		}
		return out
	}
	everywhere := []string{"a/grpc", "c/http", "d/grpc", "d/message", "e/grpc"}
	for _, c := range []struct {
		name     string
		f        idempotency.ListFilter
		pages    [][]string // the records of each page, followed by Next
		examined []int
	}{
		{"every scope", idempotency.ListFilter{AnyScope: true, Key: "k-000001"}, [][]string{everywhere}, []int{5}},
		{"two records a page", idempotency.ListFilter{AnyScope: true, Key: "k-000001", Limit: 2},
			[][]string{{"a/grpc", "c/http"}, {"d/grpc", "d/message"}, {"e/grpc"}}, nil},
		{"two scopes a page", idempotency.ListFilter{AnyScope: true, Key: "k-000001", Examine: 2},
			[][]string{{"a/grpc"}, {"c/http", "d/grpc", "d/message"}, {"e/grpc"}}, []int{2, 2, 1}},
		{"one record a page", idempotency.ListFilter{AnyScope: true, Key: "k-000001", Limit: 1},
			[][]string{{"a/grpc"}, {"c/http"}, {"d/grpc"}, {"d/message"}, {"e/grpc"}}, nil},
		{"a namespaced key", idempotency.ListFilter{AnyScope: true, Key: "http k-000001"}, [][]string{{"c/http"}}, nil},
		{"with a filter", idempotency.ListFilter{AnyScope: true, Key: "k-000001", State: "failed"}, [][]string{{"d/message"}}, nil},
		{"in one scope", idempotency.ListFilter{Scope: "d", Key: "k-000001"}, [][]string{{"d/grpc", "d/message"}}, []int{1}},
		{"nowhere", idempotency.ListFilter{AnyScope: true, Key: "nowhere"}, [][]string{nil}, []int{5}},
	} {
		f := c.f
		for i, want := range c.pages {
			page, err := store.List(ctx, f)
			require.NoError(t, err, "%s, page %d", c.name, i)
			require.Equal(t, want, found(page.Records), "%s, page %d", c.name, i)
			if c.examined != nil {
				require.Equal(t, c.examined[i], page.Examined, "%s, page %d: scopes stepped through", c.name, i)
			}
			if i == len(c.pages)-1 {
				if page.Next != "" { // a full last page may not know it is the last
					next, err := store.List(ctx, idempotency.ListFilter{AnyScope: f.AnyScope, Scope: f.Scope, Key: f.Key, State: f.State, After: page.Next})
					require.NoError(t, err)
					require.Empty(t, next.Records, "%s: nothing after the last page", c.name)
				}
				break
			}
			require.NotEmpty(t, page.Next, "%s, page %d", c.name, i)
			f.After = page.Next
		}
	}
	page, err := store.List(ctx, idempotency.ListFilter{AnyScope: true, Key: "k-000001", Examine: 2})
	require.NoError(t, err)
	_, err = store.List(ctx, idempotency.ListFilter{AnyScope: true, After: page.Next})
	require.ErrorContains(t, err, "give it the same Key", "a page between two scopes goes on only with the key")
}

// List with a Key steps from one scope to the next through the primary
// key, a thousand scopes a statement at most: its cost is the scopes, not
// the keys. Here 3,000 scopes of 20 keys each, the key in the last.
func TestListOfAKeyStepsThroughScopes(t *testing.T) {
	t.Parallel()
	traced := &listStatements{}
	db := testdb.NewConfigured(t, func(cfg *pgxpool.Config) { cfg.MaxConns = 2; cfg.ConnConfig.Tracer = traced })
	store := migratedStore(t, db)
	ctx := context.Background()
	_, err := db.Pool.Exec(ctx, `INSERT INTO idempotency_keys (scope, key, method, fingerprint, state, expires_at)
SELECT 'tenant-' || lpad(s::text, 5, '0'), 'k-' || k, 'm', '\x00', 'succeeded', now() + interval '1 day'
FROM generate_series(1, 3000) s, generate_series(1, 20) k;
DELETE FROM idempotency_keys WHERE key = 'k-1' AND scope <> 'tenant-03000';
ANALYZE idempotency_keys`)
	require.NoError(t, err)
	page, err := store.List(ctx, idempotency.ListFilter{AnyScope: true, Key: "k-1"})
	require.NoError(t, err)
	require.Len(t, page.Records, 1)
	require.Equal(t, "tenant-03000", page.Records[0].Scope)
	require.Equal(t, 3000, page.Examined, "every scope, once")
	require.Empty(t, page.Next)
	require.Len(t, traced.calls, 4, "three statements of a thousand scopes, and one that finds no more")
}

// Forget with the state "failed" deletes a failed record, so that the key
// runs again, and never a succeeded one: 16 redrives of one failed
// message at once, each forgetting and running the message again, apply
// it once. Any other state is refused, nothing forgotten.
func TestForgetFailedNeverForgetsAnAppliedEffect(t *testing.T) {
	t.Parallel()
	db := suiteDB(t)
	store := migratedStore(t, db)
	ctx := context.Background()
	m := idempotency.Message{Scope: "redrive", ID: "m-1", Body: []byte("100")}
	var applied atomic.Int64
	fail := func(context.Context, pgx.Tx) error { return idempotency.Final(errors.New("poison today")) }
	apply := func(context.Context, pgx.Tx) error { applied.Add(1); return nil }

	require.ErrorIs(t, store.Forget(ctx, m.Scope, "message m-1", "failed"), idempotency.ErrKeyNotFound)
	_, err := store.ProcessMessage(ctx, m, fail)
	require.True(t, idempotency.IsFinal(err))

	// A redrive: forget the failure, then deliver the message again.
	redrive := func() error {
		if err := store.Forget(ctx, m.Scope, "message m-1", "failed"); err != nil && !errors.Is(err, idempotency.ErrKeyNotFound) {
			return err
		}
		for {
			if _, err := store.ProcessMessage(ctx, m, apply); !idempotency.IsInProgress(err) {
				return err
			}
		}
	}
	var wg sync.WaitGroup
	errs := make([]error, 16)
	for i := range errs {
		wg.Go(func() { errs[i] = redrive() })
	}
	wg.Wait()
	// And one more, after them (an operator's repeated command).
	errs = append(errs, redrive())
	for i, err := range errs {
		if err != nil && !errors.Is(err, idempotency.ErrNotFailed) && !idempotency.IsInProgress(err) {
			t.Fatalf("redrive %d: %v", i, err)
		}
	}
	require.EqualValues(t, 1, applied.Load(), "the message is applied once")
	err = store.Forget(ctx, m.Scope, "message m-1", "failed")
	require.ErrorIs(t, err, idempotency.ErrNotFailed, "a succeeded record is kept")
	require.Contains(t, err.Error(), "succeeded")
	rec, err := store.Inspect(ctx, m.Scope, "message m-1")
	require.NoError(t, err)
	require.Equal(t, "succeeded", rec.State)

	// A gRPC call's stored final error is forgotten the same way.
	call := idempotency.Call{Scope: "redrive", Key: "k", Method: "m"}
	_, err = store.Execute(ctx, call, func(context.Context, pgx.Tx) (proto.Message, error) {
		return nil, idempotency.Final(fmt.Errorf("declined"))
	})
	require.Error(t, err)
	for _, state := range []string{"succeeded", "running", "Failed"} {
		require.ErrorContains(t, store.Forget(ctx, "redrive", "k", state), `use "failed", or "" for any`, state)
	}
	require.NoError(t, store.Forget(ctx, "redrive", "k", "failed"))
	require.ErrorIs(t, store.Forget(ctx, "redrive", "k", "failed"), idempotency.ErrKeyNotFound)
}

// Inspect and Forget reach each transport's key when named with its
// namespace, and tell a key whose call is running from a key never used.
func TestInspectAndForgetNameEachTransportsKey(t *testing.T) {
	t.Parallel()
	e := newHTTPEnv(t, nil)
	ctx := context.Background()
	require.Equal(t, http.StatusCreated, e.post("x", "charge 1").status)
	runs := 0
	fn := func(context.Context, pgx.Tx) (proto.Message, error) { runs++; return wrapperspb.String("ok"), nil }
	_, err := e.store.Execute(ctx, idempotency.Call{Key: "x", Method: "/svc/Refund"}, fn)
	require.NoError(t, err)

	rec, err := e.store.Inspect(ctx, "", "x")
	require.NoError(t, err)
	require.Equal(t, idempotency.TransportGRPC, rec.Transport)
	rec, err = e.store.Inspect(ctx, "", "http x")
	require.NoError(t, err)
	require.Equal(t, idempotency.TransportHTTP, rec.Transport)
	require.Equal(t, "x", rec.Key)
	require.Equal(t, "POST /v1/charges", rec.Method)

	require.NoError(t, e.store.Forget(ctx, "", "http x", ""), "the HTTP charge")
	_, err = e.store.Execute(ctx, idempotency.Call{Key: "x", Method: "/svc/Refund"}, fn)
	require.NoError(t, err)
	require.Equal(t, 1, runs, "the gRPC key was left alone")
	require.Equal(t, http.StatusCreated, e.post("x", "charge 1").status)
	require.Equal(t, 2, e.ledgerRows(), "the forgotten HTTP key ran again")

	holding, release := make(chan struct{}), make(chan struct{})
	done := make(chan error, 1)
	go func() {
		_, err := e.store.Execute(ctx, idempotency.Call{Key: "running", Method: "m"}, func(context.Context, pgx.Tx) (proto.Message, error) {
			close(holding)
			<-release
			return nil, nil
		})
		done <- err
	}()
	await(t, holding, "the call to hold its key")
	_, err = e.store.Inspect(ctx, "", "running")
	require.ErrorIs(t, err, idempotency.ErrInProgress, "running, not never used")
	close(release)
	require.NoError(t, await(t, done, "the call"))
	_, err = e.store.Inspect(ctx, "", "never")
	require.ErrorIs(t, err, idempotency.ErrKeyNotFound)
}
