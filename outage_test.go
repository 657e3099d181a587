package idempotency_test

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/recovery"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency/internal/faultproxy"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

const (
	outageCalls   = 400
	outageWorkers = 8
	// outageRefusal is how long the database refuses connections.
	outageRefusal = 2 * time.Second
)

// The database fails under load, twice over: the server's sessions are
// terminated with pg_terminate_backend (between, during and after calls),
// and for a few seconds the database refuses connections and every open one
// is cut. Failed attempts must be Unavailable, which the client retries;
// never Unknown, Internal or a panic. Afterwards every logical call has
// completed exactly once.
func TestDatabaseOutageUnderLoad(t *testing.T) {
	t.Parallel()
	db := suiteDB(t)
	// The server reaches PostgreSQL through a proxy that can refuse and cut
	// connections; the shared database itself is never stopped.
	pgAddr := pgAddress(t)
	proxy, err := faultproxy.New(pgAddr)
	require.NoError(t, err)
	t.Cleanup(func() { _ = proxy.Close() })
	app := "outage-" + db.Schema
	pool := schemaPool(t, db.Schema, 8, func(c *pgxpool.Config) {
		host, port, _ := net.SplitHostPort(proxy.Addr())
		p, _ := strconv.ParseUint(port, 10, 16)
		c.ConnConfig.Host, c.ConnConfig.Port = host, uint16(p)
		c.ConnConfig.ConnectTimeout = 2 * time.Second
		c.ConnConfig.RuntimeParams["application_name"] = app
	})
	var panics atomic.Int64
	srv := startReplica(t, pool, replicaConfig{
		interceptors: []grpc.UnaryServerInterceptor{recovery.UnaryServerInterceptor(recovery.WithRecoveryHandler(func(p any) error {
			panics.Add(1)
			return status.Errorf(codes.Internal, "panic: %v", p)
		}))},
		handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
			resp, err := keyedLedger(ctx, req)
			time.Sleep(time.Millisecond) // widen the window for a termination mid-call
			return resp, err
		},
	})
	// Six retries last about half a second, less than the refusal: calls
	// caught in it outlive the retry chain and the application finishes
	// them with the key it captured.
	conn, attempts := retryingClient(t, "passthrough:///"+srv.addr, 6)

	var done, retries, appRetries, terminated atomic.Int64
	terminate := func() {
		var n int64
		if err := testdb.Admin(t).QueryRow(context.Background(),
			`SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = $1`, app).Scan(&n); err != nil {
			t.Errorf("terminate the server's sessions: %v", err)
		}
		terminated.Add(n)
	}
	waitFor := func(calls int64) {
		for done.Load() < calls {
			time.Sleep(time.Millisecond)
		}
	}
	var refusedFor time.Duration
	faults := make(chan struct{})
	go func() {
		defer close(faults)
		for _, at := range []int64{40, 80, 120} {
			waitFor(at)
			terminate()
		}
		waitFor(180)
		start := time.Now()
		proxy.SetRefusing(true)
		proxy.CutAll()
		// At least outageRefusal, and until a call has outlived its retry
		// chain, however slowly the attempts go.
		time.Sleep(outageRefusal)
		for deadline := time.Now().Add(liveness); appRetries.Load() == 0 && time.Now().Before(deadline); {
			time.Sleep(time.Millisecond)
		}
		proxy.SetRefusing(false)
		refusedFor = time.Since(start)
		for _, at := range []int64{260, 300} {
			waitFor(at)
			terminate()
		}
	}()
	runLogical(t, outageCalls, outageWorkers, func(ctx context.Context, i int) (*wrapperspb.StringValue, error) {
		defer done.Add(1)
		return chargeUntilDone(ctx, conn, i, &retries, &appRetries)
	})
	<-faults

	e := &env{t: t, db: db}
	require.Empty(t, e.exactlyOnce(outageCalls))
	requireKeysMatchLedger(t, db)
	require.Equal(t, outageCalls, e.ledgerRows(), "executions")
	attempts.requireOnlyFailures(t, codes.Unavailable)
	require.Zero(t, panics.Load(), "panics")
	st := proxy.Stats()
	require.Positive(t, terminated.Load(), "sessions terminated")
	require.Positive(t, st.ConnectionsRefused, "connections refused")
	require.Positive(t, appRetries.Load(), "calls retried by the application with their captured key")
	failed, byCode := attempts.failures()
	// A commit whose connection died before its acknowledgement arrived is
	// reported Unavailable although it committed; the retry replays it.
	t.Logf("outage: %d logical calls, %d sessions terminated, %d connections cut and %d refused in %v, %d attempts failed (%s), %d retries by the interceptor, %d by the application, %d executions (%d of them committed without the server hearing back), 0 duplicates, 0 panics",
		outageCalls, terminated.Load(), st.ConnectionsCut, st.ConnectionsRefused, refusedFor.Round(time.Millisecond), failed, byCode, retries.Load(), appRetries.Load(),
		e.ledgerRows(), int64(e.ledgerRows())-srv.execs.Load())
}

// pgAddress is host:port of the test database.
func pgAddress(t *testing.T) string {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(testdb.URL())
	require.NoError(t, err)
	return net.JoinHostPort(cfg.ConnConfig.Host, fmt.Sprint(cfg.ConnConfig.Port))
}
