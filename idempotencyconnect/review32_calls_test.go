package idempotencyconnect_test

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/idempotencyconnect"
	"github.com/exactlyonce/idempotency/internal/testdb"
	testingv1 "github.com/exactlyonce/idempotency/internal/testpb/idempotency/testing/v1"
)

// The caller's deadline (Connect-Timeout-Ms) passes while the handler
// runs. A handler that honours it: DeadlineExceeded, nothing committed,
// the retry runs. A handler that ignores it and commits: the caller got
// DeadlineExceeded, and its retry gets the committed answer.
func TestReview32DeadlineMidCall(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	fn := func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		n := runs.Add(1)
		if n == 1 || n == 3 {
			<-ctx.Done()
			if n == 1 {
				return nil, ctx.Err()
			}
			// Ignores the deadline: its write goes on.
			tx := idempotency.MustTxFromContext(ctx)
			var id int64
			if err := tx.QueryRow(context.WithoutCancel(ctx), `INSERT INTO ledger (body) VALUES ($1) RETURNING id`, req.Msg.GetBody()).Scan(&id); err != nil {
				return nil, err
			}
			return connect.NewResponse(&testingv1.Response{Body: "late", LedgerId: id}), nil
		}
		resp, err := ledger(ctx, req.Msg)
		if err != nil {
			return nil, err
		}
		return connect.NewResponse(resp), nil
	}
	url := r32Mount(t, e.store, fn, nil, nil, nil)
	c := client(t, url, procRequired, protocols[0], true)
	short, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	_, err := c.CallUnary(short, keyed("r32-dl-1", "a"))
	cancel()
	require.Equal(t, connect.CodeDeadlineExceeded, connectCode(err))
	resp, err := c.CallUnary(context.Background(), keyed("r32-dl-1", "a"))
	require.NoError(t, err, "released: runs again")
	require.Equal(t, "charged a", resp.Msg.GetBody())

	short, cancel = context.WithTimeout(context.Background(), 300*time.Millisecond)
	_, err = c.CallUnary(short, keyed("r32-dl-2", "b"))
	cancel()
	require.Equal(t, connect.CodeDeadlineExceeded, connectCode(err))
	var again *connect.Response[testingv1.Response]
	waitFor(t, "the late run committed", func() bool {
		again, err = c.CallUnary(context.Background(), keyed("r32-dl-2", "b"))
		return err == nil || !idempotencyconnect.IsInProgress(err)
	})
	require.NoError(t, err)
	require.Equal(t, "late", again.Msg.GetBody(), "the committed run's answer")
	require.EqualValues(t, 3, runs.Load())
	require.Equal(t, 2, e.ledgerRows())
}

// A method whose idempotency_level is NO_SIDE_EFFECTS but which the
// option makes MODE_REQUIRED (RequiredDespiteLevel): generated connect
// code marks it NoSideEffects, so a client with WithHTTPGet sends GETs.
// The key goes with the GET and the call runs once; a POST of the same
// key is the same call.
func TestReview32GetOfARequiredMethod(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	ic, err := idempotencyconnect.NewHandlerInterceptor(e.store)
	require.NoError(t, err)
	const proc = "/idempotency.testing.v1.PolicyService/RequiredDespiteLevel"
	var gets atomic.Int64
	mux := http.NewServeMux()
	mux.Handle(proc, connect.NewUnaryHandler(proc, r32Ledger(&runs), connect.WithSchema(method("RequiredDespiteLevel")),
		connect.WithIdempotency(connect.IdempotencyNoSideEffects), connect.WithInterceptors(ic)))
	url := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodGet {
			gets.Add(1)
		}
		mux.ServeHTTP(w, r)
	}))
	cic, err := idempotencyconnect.NewClientInterceptor()
	require.NoError(t, err)
	getClient := connect.NewClient[testingv1.Request, testingv1.Response](httpClient(t, false), url+proc,
		connect.WithHTTPGet(), connect.WithIdempotency(connect.IdempotencyNoSideEffects), connect.WithInterceptors(cic))
	req := connect.NewRequest(&testingv1.Request{Body: "g"})
	first, err := getClient.CallUnary(context.Background(), req)
	require.NoError(t, err)
	require.EqualValues(t, 1, gets.Load(), "sent as GET")
	key := idempotencyconnect.KeyOf(req)
	require.NotEmpty(t, key)
	again, err := client(t, url, proc, protocols[1], true).CallUnary(context.Background(), keyed(key, "g"))
	require.NoError(t, err)
	require.Equal(t, first.Msg.GetLedgerId(), again.Msg.GetLedgerId())
	require.EqualValues(t, 1, runs.Load())
}

// A MODE_DISABLED method failing with Unavailable: nothing deduplicates a
// retry, so the client makes one attempt; a NO_SIDE_EFFECTS one is
// retried.
func TestReview32ClientRetriesOnlyWhatIsSafe(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	fn := func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		if runs.Add(1) <= 2 {
			return nil, connect.NewError(connect.CodeUnavailable, errors.New("busy"))
		}
		return connect.NewResponse(&testingv1.Response{Body: "ok"}), nil
	}
	url := r32Mount(t, e.store, fn, nil, nil, nil)
	opts := []idempotency.ClientOption{idempotency.WithRetryBackoff(time.Millisecond, time.Millisecond)}
	_, err := client(t, url, "/idempotency.testing.v1.PolicyService/Disabled", protocols[0], false, opts...).CallUnary(context.Background(), connect.NewRequest(&testingv1.Request{Body: "d"}))
	require.Equal(t, connect.CodeUnavailable, connectCode(err))
	require.EqualValues(t, 1, runs.Load(), "one attempt of a call nothing deduplicates")
	_, err = client(t, url, procNoSideEffects, protocols[0], false, opts...).CallUnary(context.Background(), connect.NewRequest(&testingv1.Request{Body: "n"}))
	require.NoError(t, err)
	require.EqualValues(t, 3, runs.Load(), "a safe call retried")
}

// Two Idempotency-Key headers, and the binary form, sent to the handler:
// InvalidArgument with the library's ErrorInfo, the handler not run.
func TestReview32TwoKeyHeadersAndBinaryKey(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	url := r32Mount(t, e.store, r32Ledger(&runs), nil, nil, nil)
	for name, set := range map[string]func(h http.Header){
		"two":     func(h http.Header) { h.Add("Idempotency-Key", "a"); h.Add("Idempotency-Key", "b") },
		"twosame": func(h http.Header) { h.Add("Idempotency-Key", "a"); h.Add("idempotency-key", "a") },
		"bin":     func(h http.Header) { h.Set("Idempotency-Key-Bin", connect.EncodeBinaryHeader([]byte("a"))) },
		"both":    func(h http.Header) { h.Set("Idempotency-Key", "a"); h.Set("Idempotency-Key-Bin", "YQ") },
	} {
		for _, p := range protocols {
			req := connect.NewRequest(&testingv1.Request{Body: "k"})
			set(req.Header())
			_, err := client(t, url, procRequired, p, true).CallUnary(context.Background(), req)
			require.Equal(t, connect.CodeInvalidArgument, connectCode(err), "%s %s: %v", name, p.name, err)
			found := false
			for _, d := range errDetails(t, err) {
				if info, ok := d.(interface{ GetDomain() string }); ok && info.GetDomain() == idempotency.ErrorDomain {
					found = true
				}
			}
			require.True(t, found, "%s %s: the library's ErrorInfo", name, p.name)
		}
	}
	require.EqualValues(t, 0, runs.Load())
}

// 16 callers of one key at once: connect clients in every protocol to a
// connect handler, and grpc-go clients to a grpc-go server with
// UnaryServerInterceptor on the same store, on a database whose sessions
// default to SERIALIZABLE: one run, one row, one answer.
func TestReview32SixteenCallersAcrossFrameworksSerializable(t *testing.T) {
	t.Parallel()
	db := testdb.NewConfigured(t, func(c *pgxpool.Config) {
		c.ConnConfig.RuntimeParams["default_transaction_isolation"] = "serializable"
		c.MaxConns = 8
	})
	store, err := idempotency.NewStore(db.Pool)
	require.NoError(t, err)
	ctx := context.Background()
	require.NoError(t, store.Migrate(ctx))
	_, err = db.Pool.Exec(ctx, `CREATE TABLE ledger (id bigserial PRIMARY KEY, body text NOT NULL)`)
	require.NoError(t, err)
	var runs atomic.Int64
	hold := make(chan struct{})
	work := func(ctx context.Context, req *testingv1.Request) (*testingv1.Response, error) {
		runs.Add(1)
		<-hold
		return ledger(ctx, req)
	}
	url := r32Mount(t, store, func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		resp, err := work(ctx, req.Msg)
		if err != nil {
			return nil, err
		}
		return connect.NewResponse(resp), nil
	}, nil, nil, nil)
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(idempotency.UnaryServerInterceptor(store)))
	testingv1.RegisterPolicyServiceServer(srv, r32Work{work: work})
	lis := listen(t)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	grpcURL := "http://" + lis.Addr().String()
	gc := grpcClient(t, grpcURL, idempotency.UnaryClientInterceptor(idempotency.WithRetryBackoff(5*time.Millisecond, 20*time.Millisecond)))

	const n = 16
	ids := make([]int64, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			kctx := idempotency.WithOutgoingKey(ctx, "r32-sixteen")
			if i%5 == 4 {
				resp, err := gc.Required(kctx, &testingv1.Request{Body: "16"})
				errs[i] = err
				ids[i] = resp.GetLedgerId()
				return
			}
			resp, err := client(t, url, procRequired, protocols[i%len(protocols)], false, idempotency.WithRetryBackoff(5*time.Millisecond, 20*time.Millisecond)).
				CallUnary(kctx, connect.NewRequest(&testingv1.Request{Body: "16"}))
			errs[i] = err
			if err == nil {
				ids[i] = resp.Msg.GetLedgerId()
			}
		})
	}
	waitFor(t, "the first run", func() bool { return runs.Load() >= 1 })
	time.Sleep(200 * time.Millisecond) // let the others meet the running call (not asserted on)
	close(hold)
	wg.Wait()
	for i := range n {
		require.NoError(t, errs[i], "caller %d", i)
		require.Equal(t, ids[0], ids[i], "caller %d", i)
	}
	require.EqualValues(t, 1, runs.Load())
	require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM ledger`))
}

type r32Work struct {
	testingv1.UnimplementedPolicyServiceServer
	work func(context.Context, *testingv1.Request) (*testingv1.Response, error)
}

func (w r32Work) Required(ctx context.Context, req *testingv1.Request) (*testingv1.Response, error) {
	return w.work(ctx, req)
}

var (
	_ = strings.Contains
	_ = metadata.Pairs
)
