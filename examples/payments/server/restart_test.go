package main

import (
	"context"
	"fmt"
	"maps"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/exactlyonce/idempotency"
	paymentsv1 "github.com/exactlyonce/idempotency/examples/payments/proto/payments/v1"
	"github.com/exactlyonce/idempotency/examples/payments/provider"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// The server as deployed: its binary, killed with SIGKILL in the middle of
// a load of charges while charges the provider made are not yet committed,
// then started again with the same flags (its provider on a fresh port),
// or replaced by a replica that names the provider otherwise (a rolling
// change of -provider-url). Every key sent again answers OK, and the
// provider's charges, the ledger's rows and the keys are as many. Before
// the provider compared a key's requests by what they ask for, the
// charges in flight at the kill were sent again under their derived keys
// to a provider reached by another name, which refused them (422); the
// keys stored FailedPrecondition for charges the provider had made.
func TestServerKilledMidLoadAnswersEveryKey(t *testing.T) {
	// keys unique charges from concurrency clients; the kill lands when
	// at least killAfter were answered and all concurrency are in flight.
	const keys, concurrency, killAfter = 300, 24, 100
	for _, tc := range []struct {
		name string
		// -provider-url of the process killed and of the one after it,
		// with %s for the port of a provider this test serves; empty for
		// both: each process serves the provider itself, on a fresh port
		// (the default -provider-addr 127.0.0.1:0), its state in the
		// database.
		first, second string
	}{
		{name: "restarted with the same flags", first: "", second: ""},
		{name: "replaced by a replica naming the provider otherwise", first: "http://127.0.0.1:%s", second: "http://localhost:%s"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			db := testdb.New(t, 4)
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute) // a liveness bound only
			defer cancel()
			addr := freeAddr(t)
			flags := func(providerURL string) []string {
				f := []string{"-addr", addr, "-http-addr", "", "-connect-addr", "", "-metrics-addr", "", "-database-url", db.URL()}
				if providerURL != "" {
					f = append(f, "-provider-url", providerURL)
				}
				return f
			}
			first, second := flags(tc.first), flags(tc.second)
			if tc.first != "" {
				port := serveProvider(t, db)
				first, second = flags(fmt.Sprintf(tc.first, port)), flags(fmt.Sprintf(tc.second, port))
			}
			charge := func(ctx context.Context, client paymentsv1.PaymentServiceClient, i int) error {
				_, err := client.Charge(idempotency.WithOutgoingKey(ctx, fmt.Sprintf("restart-%d", i)),
					&paymentsv1.ChargeRequest{AccountId: fmt.Sprintf("acct-%d", i%20), AmountCents: 1 + int64(i%7)})
				return err
			}

			killed := startServer(t, first)
			client := serverClient(t, ctx, addr)
			providerBefore := killed.providerName(t, first)
			loadCtx, stopLoad := context.WithCancel(ctx)
			var answered atomic.Int64
			loaded := make(chan struct{})
			go func() {
				defer close(loaded)
				chargeAll(keys, concurrency, func(i int) error {
					if loadCtx.Err() != nil {
						return loadCtx.Err()
					}
					err := charge(loadCtx, client, i)
					if err == nil {
						answered.Add(1)
					}
					return err
				})
			}()
			require.Eventually(t, func() bool { return answered.Load() >= killAfter }, 2*time.Minute, 5*time.Millisecond,
				"%d charges answered before the kill", killAfter)

			// Hold every charge between the provider's answer and its
			// ledger row: a lock that the ledger's INSERT waits for. The
			// kill then lands on concurrency charges the provider made and
			// the service has not committed, as observed below.
			hold, err := db.Pool.Begin(ctx)
			require.NoError(t, err)
			defer func() { _ = hold.Rollback(context.Background()) }()
			_, err = hold.Exec(ctx, `LOCK TABLE ledger IN SHARE MODE`)
			require.NoError(t, err)
			require.Eventually(t, func() bool {
				return db.Count(t, `SELECT count(*) FROM pg_locks WHERE relation = 'ledger'::regclass AND NOT granted`) == concurrency
			}, 2*time.Minute, 5*time.Millisecond, "all %d charges in flight wait for the ledger", concurrency)
			ledgerAtKill := db.Count(t, `SELECT count(*) FROM ledger`)
			require.Equal(t, ledgerAtKill+concurrency, db.Count(t, `SELECT count(*) FROM provider_charges`),
				"the provider made the %d charges in flight", concurrency)
			require.Less(t, ledgerAtKill, keys, "the kill lands before the load's end")

			killed.kill(t)
			stopLoad()
			<-loaded
			require.NoError(t, hold.Rollback(ctx))
			require.Equal(t, ledgerAtKill, db.Count(t, `SELECT count(*) FROM ledger`), "the killed process committed nothing more")

			restarted := startServer(t, second)
			client = serverClient(t, ctx, addr)
			require.NotEqual(t, providerBefore, restarted.providerName(t, second), "the provider is reached by another name")
			var mu sync.Mutex
			failures := map[string]int{}
			failed := chargeAll(keys, concurrency, func(i int) error {
				err := charge(ctx, client, i)
				if err != nil {
					mu.Lock()
					failures[fmt.Sprintf("%v: %.160s", status.Code(err), status.Convert(err).Message())]++
					mu.Unlock()
				}
				return err
			})
			require.Zero(t, failed, "%d of %d keys sent again did not answer OK: %s", failed, keys, describe(failures))
			require.Equal(t, keys, db.Count(t, `SELECT count(*) FROM provider_charges`), "one provider charge per key")
			require.Equal(t, keys, db.Count(t, `SELECT count(*) FROM ledger`), "one ledger row per key")
			require.Equal(t, keys, db.Count(t, `SELECT count(DISTINCT provider_charges.id) FROM ledger JOIN provider_charges ON provider_charges.id = ledger.provider_charge_id`),
				"every ledger row names its own provider charge")
			var want int
			for i := range keys {
				want += 1 + i%7
			}
			require.Equal(t, want, db.Count(t, `SELECT sum(balance_cents)::int FROM accounts`))
		})
	}
}

// describe lists failures by count, most frequent first.
func describe(failures map[string]int) string {
	msgs := slices.SortedFunc(maps.Keys(failures), func(a, b string) int { return failures[b] - failures[a] })
	var b strings.Builder
	for _, m := range msgs {
		fmt.Fprintf(&b, "\n  %d× %s", failures[m], m)
	}
	return b.String()
}

// chargeAll runs do(i) for every i in [0, n) on workers goroutines and
// returns how many failed.
func chargeAll(n, workers int, do func(i int) error) int {
	var failed atomic.Int64
	next := make(chan int)
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for i := range next {
				if do(i) != nil {
					failed.Add(1)
				}
			}
		})
	}
	for i := range n {
		next <- i
	}
	close(next)
	wg.Wait()
	return int(failed.Load())
}

// freeAddr is a loopback address no one listens on, for a process that
// must listen on the same address after it is restarted.
func freeAddr(t *testing.T) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := lis.Addr().String()
	require.NoError(t, lis.Close())
	return addr
}

// serveProvider serves the example provider from this process, on its own
// pool and tables in db, and returns its port: the provider that replicas
// of the service share, and that outlives them.
func serveProvider(t *testing.T, db *testdb.DB) string {
	t.Helper()
	store, err := provider.NewStore(db.OpenPool(t, 4))
	require.NoError(t, err)
	require.NoError(t, provider.Migrate(context.Background(), db.Pool, store))
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv := &http.Server{Handler: provider.NewHandler(store), ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(func() { _ = srv.Close() })
	_, port, err := net.SplitHostPort(lis.Addr().String())
	require.NoError(t, err)
	return port
}

// serverClient is a client of the server at addr through the library's
// chain, once the server answers.
func serverClient(t *testing.T, ctx context.Context, addr string) paymentsv1.PaymentServiceClient {
	t.Helper()
	conn, err := grpc.NewClient("passthrough:///"+addr,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithUnaryInterceptor(idempotency.UnaryClientInterceptor()))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	client := paymentsv1.NewPaymentServiceClient(conn)
	require.Eventually(t, func() bool {
		cctx, cancel := context.WithTimeout(ctx, time.Second)
		defer cancel()
		_, err := client.GetBalance(cctx, &paymentsv1.GetBalanceRequest{AccountId: "ready"})
		return err == nil
	}, time.Minute, 20*time.Millisecond, "the server at %s answers", addr)
	return client
}

// serverProcess is the server's binary, running.
type serverProcess struct {
	cmd    *exec.Cmd
	logs   testdb.SyncBuffer
	exited chan struct{}
}

// startServer runs the server's binary with args. When t ends it is
// stopped with SIGTERM, if it still runs, and its log is shown if t
// failed.
func startServer(t *testing.T, args []string) *serverProcess {
	t.Helper()
	p := &serverProcess{cmd: exec.Command(serverBinary(t), args...), exited: make(chan struct{})}
	p.cmd.Stdout, p.cmd.Stderr = &p.logs, &p.logs
	require.NoError(t, p.cmd.Start())
	go func() { _ = p.cmd.Wait(); close(p.exited) }()
	t.Cleanup(func() {
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-p.exited:
		case <-time.After(30 * time.Second):
			_ = p.cmd.Process.Kill()
			<-p.exited
		}
		if t.Failed() {
			t.Logf("server %v, the end of its log:\n%s", args, lastLines(p.logs.String(), 30))
		}
	})
	return p
}

// providerName is how the process started with args names its provider:
// its -provider-url, else the address it serves the provider on, as it
// logs it.
func (p *serverProcess) providerName(t *testing.T, args []string) string {
	t.Helper()
	if i := slices.Index(args, "-provider-url"); i >= 0 {
		return args[i+1]
	}
	const served = `msg="example payment provider listening" http=`
	var addr string
	require.Eventually(t, func() bool {
		_, after, ok := strings.Cut(p.logs.String(), served)
		addr, _, _ = strings.Cut(after, "\n")
		return ok
	}, time.Minute, 10*time.Millisecond, "the server logs its provider's address")
	return "http://" + addr
}

// lastLines is the last n lines of s.
func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

// kill kills the process with SIGKILL and waits for it to be gone.
func (p *serverProcess) kill(t *testing.T) {
	t.Helper()
	require.NoError(t, p.cmd.Process.Kill())
	<-p.exited
	require.Equal(t, syscall.SIGKILL, p.cmd.ProcessState.Sys().(syscall.WaitStatus).Signal(), "the server died of SIGKILL:\n%s", p.logs.String())
}

// serverBinary builds the server once per test binary.
func serverBinary(t *testing.T) string {
	t.Helper()
	buildOnce.Do(func() {
		dir, err := os.MkdirTemp("", "payments-server")
		if err != nil {
			buildErr = err
			return
		}
		builtPath = filepath.Join(dir, "server")
		if out, err := exec.Command("go", "build", "-o", builtPath, ".").CombinedOutput(); err != nil {
			buildErr = fmt.Errorf("go build: %v\n%s", err, out)
		}
	})
	require.NoError(t, buildErr, "build the server")
	return builtPath
}

var (
	buildOnce sync.Once
	builtPath string
	buildErr  error
)
