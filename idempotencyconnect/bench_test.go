package idempotencyconnect_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/idempotencyconnect"
	"github.com/exactlyonce/idempotency/internal/testdb"
	testingv1 "github.com/exactlyonce/idempotency/internal/testpb/idempotency/testing/v1"
)

// BenchmarkFreshCall makes calls that each write one ledger row, with a
// new key each, side by side in each round, through three transports with
// the library and without:
//
//   - connect/plain, connect/fresh: a connect-go handler (Connect
//     protocol, binary, HTTP/1.1), without and with
//     idempotencyconnect's interceptors (the client's included);
//   - grpc/plain, grpc/fresh: a grpc-go server, without and with
//     UnaryServerInterceptor and the client chain;
//   - http/plain, http/fresh: a net/http handler, without and with
//     HTTPMiddleware.
//
// A plain handler writes its row in a transaction of its own; a fresh one
// writes it through the call's transaction, which also holds the key's
// row: the difference is the price of a durable, deduplicated record. 8
// callers at once, each transport on a pool of 10. It reports calls/s;
// compare the pairs within a round:
//
//	go -C idempotencyconnect test -run '^$' -bench FreshCall -benchtime 3s -count 6 .
func BenchmarkFreshCall(b *testing.B) {
	db := testdb.New(b, 4)
	ctx := context.Background()
	pool := benchPool(b, db)
	store, err := idempotency.NewStore(pool)
	if err != nil {
		b.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil {
		b.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE ledger (id bigserial PRIMARY KEY, body text NOT NULL)`); err != nil {
		b.Fatal(err)
	}
	write := func(ctx context.Context, req *testingv1.Request) (*testingv1.Response, error) {
		var id int64
		insert := func(tx pgx.Tx) error {
			return tx.QueryRow(ctx, `INSERT INTO ledger (body) VALUES ($1) RETURNING id`, req.GetBody()).Scan(&id)
		}
		if tx, ok := idempotency.TxFromContext(ctx); ok {
			err := insert(tx)
			return &testingv1.Response{Body: "charged", LedgerId: id}, err
		}
		err := pgx.BeginFunc(ctx, pool, insert)
		return &testingv1.Response{Body: "charged", LedgerId: id}, err
	}
	var seq atomic.Int64
	key := func() string {
		return "bench-" + strconv.FormatInt(seq.Add(1), 10) + "-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	}

	variants := []struct {
		name string
		call func(b *testing.B) func() error
	}{
		{"connect/plain", connectCaller(store, write, false)},
		{"connect/fresh", connectCaller(store, write, true)},
		{"grpc/plain", grpcCaller(store, write, false, key)},
		{"grpc/fresh", grpcCaller(store, write, true, key)},
		{"http/plain", httpCaller(store, write, false, key)},
		{"http/fresh", httpCaller(store, write, true, key)},
	}
	for _, v := range variants {
		b.Run(v.name, func(b *testing.B) {
			call := v.call(b)
			b.SetParallelism(4) // 8 callers on 2 CPUs
			start := time.Now()
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					if err := call(); err != nil {
						b.Error(err)
						return
					}
				}
			})
			b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "calls/s")
		})
	}
}

func benchPool(b *testing.B, db *testdb.DB) *pgxpool.Pool {
	cfg, err := pgxpool.ParseConfig(db.URL())
	if err != nil {
		b.Fatal(err)
	}
	cfg.MaxConns = 10
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(pool.Close)
	return pool
}

type writer = func(context.Context, *testingv1.Request) (*testingv1.Response, error)

func benchHTTPClient(b *testing.B, h2c bool) *http.Client {
	tr := &http.Transport{MaxIdleConnsPerHost: 64}
	if h2c {
		tr.Protocols = new(http.Protocols)
		tr.Protocols.SetUnencryptedHTTP2(true)
	}
	b.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr}
}

func connectCaller(store *idempotency.Store, write writer, protected bool) func(b *testing.B) func() error {
	return func(b *testing.B) func() error {
		var mux http.Handler
		var copts []connect.ClientOption
		if protected {
			mux = handlers(b, store, write)
			ic, err := idempotencyconnect.NewClientInterceptor()
			if err != nil {
				b.Fatal(err)
			}
			copts = append(copts, connect.WithInterceptors(ic))
		} else {
			m := http.NewServeMux()
			m.Handle(procRequired, connect.NewUnaryHandler(procRequired, func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
				resp, err := write(ctx, req.Msg)
				if err != nil {
					return nil, err
				}
				return connect.NewResponse(resp), nil
			}))
			mux = m
		}
		url := serve(b, mux)
		c := connect.NewClient[testingv1.Request, testingv1.Response](benchHTTPClient(b, false), url+procRequired, copts...)
		return func() error {
			_, err := c.CallUnary(context.Background(), connect.NewRequest(&testingv1.Request{Body: "100"}))
			return err
		}
	}
}

func grpcCaller(store *idempotency.Store, write writer, protected bool, key func() string) func(b *testing.B) func() error {
	return func(b *testing.B) func() error {
		var sopts []grpc.ServerOption
		var copts []grpc.UnaryClientInterceptor
		if protected {
			sopts = append(sopts, grpc.ChainUnaryInterceptor(idempotency.UnaryServerInterceptor(store)))
			copts = []grpc.UnaryClientInterceptor{idempotency.UnaryClientInterceptor()}
		}
		srv := grpc.NewServer(sopts...)
		testingv1.RegisterPolicyServiceServer(srv, benchService{write: write})
		lis := listen(b)
		go func() { _ = srv.Serve(lis) }()
		b.Cleanup(srv.Stop)
		c := grpcClient(b, "http://"+lis.Addr().String(), copts...)
		return func() error {
			ctx := context.Background()
			if !protected {
				ctx = metadata.AppendToOutgoingContext(ctx, "x-request", key()) // the same metadata's cost
			}
			_, err := c.Required(ctx, &testingv1.Request{Body: "100"})
			return err
		}
	}
}

type benchService struct {
	testingv1.UnimplementedPolicyServiceServer
	write writer
}

func (s benchService) Required(ctx context.Context, req *testingv1.Request) (*testingv1.Response, error) {
	return s.write(ctx, req)
}

func httpCaller(store *idempotency.Store, write writer, protected bool, key func() string) func(b *testing.B) func() error {
	return func(b *testing.B) func() error {
		var h http.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			body, _ := io.ReadAll(r.Body)
			resp, err := write(r.Context(), &testingv1.Request{Body: string(body)})
			if err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			w.Header().Set("Content-Type", "application/json")
			fmt.Fprintf(w, `{"ledger_id":%d}`, resp.GetLedgerId())
		})
		if protected {
			h = idempotency.HTTPMiddleware(store)(h)
		}
		mux := http.NewServeMux()
		mux.Handle("POST /v1/charges", h)
		url := serve(b, mux) + "/v1/charges"
		client := benchHTTPClient(b, false)
		return func() error {
			req, _ := http.NewRequest(http.MethodPost, url, bytes.NewBufferString("100"))
			req.Header.Set(idempotency.HeaderKey, key())
			resp, err := client.Do(req)
			if err != nil {
				return err
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				return fmt.Errorf("status %d", resp.StatusCode)
			}
			return nil
		}
	}
}
