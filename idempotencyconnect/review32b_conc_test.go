package idempotencyconnect_test

import (
	"context"
	"fmt"
	"strconv"
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
	"github.com/exactlyonce/idempotency/internal/testdb"
	testingv1 "github.com/exactlyonce/idempotency/internal/testpb/idempotency/testing/v1"
)

// 20 calls of distinct keys at once, through connect's four protocols and
// grpc-go (to a grpc-go server on the same store), on a database whose
// sessions default to SERIALIZABLE with a short statement and lock
// timeout, each a read-modify-write of one balance row: the database
// aborts most runs, the layer answers Aborted with RetryInfo, the clients
// retry. Every key applies once (the balance is 20), and every answer and
// its replay carry the headers of the run that committed (the run's number
// is in the ledger row it wrote), never those of an aborted run.
func TestReview32bSerializableContentionHeadersOfTheCommittedRun(t *testing.T) {
	t.Parallel()
	db := testdb.NewConfigured(t, func(c *pgxpool.Config) {
		c.ConnConfig.RuntimeParams["default_transaction_isolation"] = "serializable"
		c.ConnConfig.RuntimeParams["statement_timeout"] = "2s"
		c.ConnConfig.RuntimeParams["lock_timeout"] = "1s"
		c.MaxConns = 8
	})
	store, err := idempotency.NewStore(db.Pool)
	require.NoError(t, err)
	ctx := context.Background()
	require.NoError(t, store.Migrate(ctx))
	_, err = db.Pool.Exec(ctx, `CREATE TABLE ledger (id bigserial PRIMARY KEY, body text NOT NULL);
		CREATE TABLE balance (id int PRIMARY KEY, v int NOT NULL); INSERT INTO balance VALUES (1, 0)`)
	require.NoError(t, err)
	var runs atomic.Int64
	// work is one run: its number goes in the ledger row and in the
	// headers and trailers it sets.
	work := func(ctx context.Context, req *testingv1.Request, set func(h, tr string)) (*testingv1.Response, error) {
		n := runs.Add(1)
		set(fmt.Sprint(n), fmt.Sprint(n))
		tx := idempotency.MustTxFromContext(ctx)
		var v int
		if err := tx.QueryRow(ctx, `SELECT v FROM balance WHERE id = 1`).Scan(&v); err != nil {
			return nil, err
		}
		time.Sleep(5 * time.Millisecond) // widen the window between the read and the write
		if _, err := tx.Exec(ctx, `UPDATE balance SET v = $1 WHERE id = 1`, v+1); err != nil {
			return nil, err
		}
		var id int64
		if err := tx.QueryRow(ctx, `INSERT INTO ledger (body) VALUES ($1) RETURNING id`, fmt.Sprint(n)).Scan(&id); err != nil {
			return nil, err
		}
		return &testingv1.Response{Body: fmt.Sprint(n), LedgerId: id}, nil
	}
	url := r32Mount(t, store, func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		info, _ := connect.CallInfoForHandlerContext(ctx)
		var hdr string
		resp, err := work(ctx, req.Msg, func(h, tr string) {
			info.ResponseHeader().Set("X-Run", h)
			info.ResponseTrailer().Set("X-Run-Trailer", tr)
			hdr = h
		})
		if err != nil {
			return nil, err
		}
		r := connect.NewResponse(resp)
		r.Header().Set("X-Run-Resp", hdr)
		return r, nil
	}, nil, nil, nil)
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(idempotency.UnaryServerInterceptor(store)))
	testingv1.RegisterPolicyServiceServer(srv, r32Work{work: func(ctx context.Context, req *testingv1.Request) (*testingv1.Response, error) {
		return work(ctx, req, func(h, tr string) {
			_ = grpc.SetHeader(ctx, metadata.Pairs("x-run", h, "x-run-resp", h))
			_ = grpc.SetTrailer(ctx, metadata.Pairs("x-run-trailer", tr))
		})
	}})
	lis := listen(t)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	copts := []idempotency.ClientOption{idempotency.WithRetryBackoff(2*time.Millisecond, 20*time.Millisecond)}
	gc := grpcClient(t, "http://"+lis.Addr().String(), idempotency.UnaryClientInterceptor(copts...))

	// answer is what a caller saw: the body and the three run numbers.
	type answer struct{ body, hdr, resp, trailer string }
	call := func(i int, key string) (answer, error) {
		kctx := idempotency.WithOutgoingKey(ctx, key)
		if i%5 == 4 {
			var h, tr metadata.MD
			resp, err := gc.Required(kctx, &testingv1.Request{Body: "c"}, grpc.Header(&h), grpc.Trailer(&tr))
			if err != nil {
				return answer{}, err
			}
			first := func(md metadata.MD, k string) string {
				if v := md.Get(k); len(v) > 0 {
					return v[0]
				}
				return ""
			}
			return answer{resp.GetBody(), first(h, "x-run"), first(h, "x-run-resp"), first(tr, "x-run-trailer")}, nil
		}
		resp, err := client(t, url, procRequired, protocols[i%len(protocols)], false, copts...).CallUnary(kctx, connect.NewRequest(&testingv1.Request{Body: "c"}))
		if err != nil {
			return answer{}, err
		}
		return answer{resp.Msg.GetBody(), resp.Header().Get("X-Run"), resp.Header().Get("X-Run-Resp"), resp.Trailer().Get("X-Run-Trailer")}, nil
	}
	const n = 20
	answers := make([]answer, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { answers[i], errs[i] = call(i, "r32b-ser-"+strconv.Itoa(i)) })
	}
	wg.Wait()
	for i := range n {
		require.NoError(t, errs[i], "caller %d", i)
		a := answers[i]
		require.Equal(t, answer{a.body, a.body, a.body, a.body}, a, "caller %d: the headers of the run that committed", i)
		again, err := call(i, "r32b-ser-"+strconv.Itoa(i))
		require.NoError(t, err)
		require.Equal(t, a, again, "caller %d: the replay", i)
		// The same key through the other framework.
		elsewhere := 4 // grpc-go
		if i%5 == 4 {
			elsewhere = i + 1 // connect
		}
		other, err := call(elsewhere, "r32b-ser-"+strconv.Itoa(i))
		require.NoError(t, err)
		require.Equal(t, a, other, "caller %d: the replay elsewhere", i)
	}
	require.Equal(t, n, db.Count(t, `SELECT v FROM balance`))
	require.Equal(t, n, db.Count(t, `SELECT count(*) FROM ledger`))
	t.Logf("%d runs for %d calls", runs.Load(), n)
}
