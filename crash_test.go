package idempotency_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/crashproc"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

const (
	// crashChildEnv, when set, makes the test binary serve as the crash
	// test's server: "<schema> <kill point> <n>" kills the process at the
	// n-th time a call reaches the point.
	crashChildEnv = "IDEMPOTENCY_CRASH_CHILD"
	// crashSeedEnv replays a crash schedule: set it to the seed a failed
	// run printed.
	crashSeedEnv = "IDEMPOTENCY_CRASH_SEED"

	crashKills   = 60
	crashWorkers = 8
	// crashInProgressWait is long on purpose: a key left held by a killed
	// process would make its retry wait this long and end in Aborted.
	crashInProgressWait = 10 * time.Second
)

// crashPoints are where the server kills itself, in the order a call
// reaches them: in an interceptor before ours (before the claim), in the
// handler after its business write, when the commit is about to be sent,
// and after the commit but before the response is sent.
var crashPoints = []string{"before-claim", "after-business-write", "before-commit", "after-commit"}

// The server is killed with SIGKILL 60 times, 15 at each of the four
// points, after a seeded number of calls. Clients keep retrying
// through the restarts. Every logical call must finish with its own
// response, the business effect must happen exactly once per logical call,
// every key must have its ledger row and every ledger row its key, and no
// retry may wait for a key held by the dead process.
func TestCrashAtEveryPointLosesNothing(t *testing.T) {
	t.Parallel()
	seed := time.Now().UnixNano()
	if s := os.Getenv(crashSeedEnv); s != "" {
		var err error
		seed, err = strconv.ParseInt(s, 10, 64)
		require.NoError(t, err, crashSeedEnv)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("crash schedule seed %d; replay it with %s=%d go test -race -run 'TestCrashAtEveryPointLosesNothing$'", seed, crashSeedEnv, seed)
		}
	})
	rng := rand.New(rand.NewPCG(uint64(seed), 0))

	db := suiteDB(t)
	// The test holds the listening socket and hands it to each server
	// process, so clients reconnect to the same address and wait in its
	// backlog while no server runs.
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = lis.Close() })
	lisFile, err := lis.(*net.TCPListener).File()
	require.NoError(t, err)
	t.Cleanup(func() { _ = lisFile.Close() })
	conn, attempts := retryingClient(t, "passthrough:///"+lis.Addr().String(), 20)

	ctx, cancel := context.WithCancel(context.Background())
	var (
		next, retries, appRetries atomic.Int64
		stop                      atomic.Bool
		wg                        sync.WaitGroup
		mu                        sync.Mutex
		failures                  []string
	)
	t.Cleanup(func() { cancel(); wg.Wait() }) // before conn closes: cleanups run last-in first-out
	for range crashWorkers {
		wg.Go(func() {
			for !stop.Load() && ctx.Err() == nil {
				i := int(next.Add(1) - 1)
				cctx, ccancel := context.WithTimeout(ctx, time.Minute)
				resp, err := chargeUntilDone(cctx, conn, i, &retries, &appRetries)
				ccancel()
				if err == nil && !strings.HasPrefix(resp.GetValue(), body(i)+"#") {
					err = fmt.Errorf("got response %q, which belongs to another call", resp.GetValue())
				}
				if err != nil {
					mu.Lock()
					failures = append(failures, fmt.Sprintf("%s: %v", body(i), err))
					mu.Unlock()
				}
			}
		})
	}

	kills := map[string]int{}
	for k := 0; k < crashKills; k += len(crashPoints) {
		for _, p := range rng.Perm(len(crashPoints)) {
			point := crashPoints[p]
			child := startCrashChild(t, lisFile, db.Schema, point, 1+rng.IntN(8))
			child.RequireKilled(t, point)
			kills[point]++
		}
	}
	final := startCrashChild(t, lisFile, db.Schema, "none", 0)
	stop.Store(true)
	wg.Wait()
	final.Kill()

	n := int(next.Load())
	require.Empty(t, failures, "every logical call must finish with its own response")
	e := &env{t: t, db: db}
	require.Empty(t, e.exactlyOnce(n), "business effect per logical call")
	require.Equal(t, n, e.ledgerRows(), "ledger rows")
	requireKeysMatchLedger(t, db)
	// A dead server loses the connection: Unavailable. Aborted would mean a
	// retry waited for a key that a killed server still held.
	attempts.requireOnlyFailures(t, codes.Unavailable)
	failed, byCode := attempts.failures()
	total := 0
	for _, k := range kills {
		total += k
	}
	t.Logf("crash: seed %d, %d kills (%v), %d logical calls, %d attempts failed (%s), %d retries by the interceptor, %d by the application, %d executions, 0 duplicates, longest attempt %v (in-progress wait %v)",
		seed, total, kills, n, failed, byCode, retries.Load(), appRetries.Load(), e.ledgerRows(), attempts.longest.Round(time.Millisecond), crashInProgressWait)
}

func startCrashChild(t *testing.T, lis *os.File, schema, point string, at int) *crashproc.Child {
	t.Helper()
	return crashproc.Start(t, []string{fmt.Sprintf("%s=%s %s %d", crashChildEnv, schema, point, at)}, lis)
}

// runCrashChild is the server process of the crash test: the suite's ledger
// server on the listening socket inherited as fd 3, which kills itself at
// the configured point.
func runCrashChild() int {
	return crashproc.Main(serveCrashChild)
}

func serveCrashChild() error {
	var schema, point string
	var at int64
	if _, err := fmt.Sscan(os.Getenv(crashChildEnv), &schema, &point, &at); err != nil {
		return fmt.Errorf("%s: %w", crashChildEnv, err)
	}
	k := &killSwitch{point: point, at: at}
	cfg, err := pgxpool.ParseConfig(testdb.URL())
	if err != nil {
		return err
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	cfg.MaxConns = 8
	cfg.ConnConfig.Tracer = k.tracer()
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	store, err := idempotency.NewStore(pool, idempotency.WithInProgressWait(crashInProgressWait),
		idempotency.WithTracer(endTracer(func(_ context.Context, data idempotency.TraceCallEndData) {
			if data.Outcome == idempotency.OutcomeExecuted {
				k.hit("after-commit")
			}
		})))
	if err != nil {
		return err
	}
	lis, err := crashproc.Listener()
	if err != nil {
		return err
	}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(
		func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
			k.hit("before-claim")
			return h(ctx, req)
		},
		idempotency.UnaryServerInterceptor(store),
	))
	srv.RegisterService(ledgerDesc(), &ledger{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		resp, err := keyedLedger(ctx, req)
		if err == nil {
			k.hit("after-business-write")
		}
		return resp, err
	}})
	crashproc.Ready()
	return srv.Serve(lis)
}

// killSwitch kills the process with SIGKILL the at-th time a call reaches
// point. Its tracer sees a commit about to be sent, alone or at the end of a
// batch.
type killSwitch struct {
	point string
	at    int64
	n     atomic.Int64
}

func (k *killSwitch) tracer() *testdb.Tracer {
	return &testdb.Tracer{OnRoundTrip: func(_ context.Context, _ *pgx.Conn, statements []string) {
		if testdb.HasCommit(statements) {
			k.hit("before-commit")
		}
	}}
}

func (k *killSwitch) hit(point string) {
	if point != k.point || k.n.Add(1) != k.at {
		return
	}
	crashproc.KillSelf()
}
