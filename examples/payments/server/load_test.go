package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/idempotency"
	paymentsv1 "github.com/exactlyonce/idempotency/examples/payments/proto/payments/v1"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// startDefault starts the server as main does, with its default flags but
// for the addresses of its own services (free ports, so that tests can run
// side by side) and the test's database. It stops when t ends.
func startDefault(t *testing.T, databaseURL string) listeners {
	t.Helper()
	cfg, err := parseFlags(flag.NewFlagSet("server", flag.ContinueOnError),
		[]string{"-addr", "127.0.0.1:0", "-http-addr", "127.0.0.1:0", "-connect-addr", "127.0.0.1:0", "-metrics-addr", "127.0.0.1:0", "-database-url", databaseURL})
	require.NoError(t, err)
	lis, err := openListeners(cfg)
	require.NoError(t, err, "listen with the default flags")
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan error, 1)
	go func() { stopped <- run(ctx, lis, cfg, slog.New(slog.NewTextHandler(io.Discard, nil))) }()
	t.Cleanup(func() { cancel(); requireStopped(t, stopped) })
	return lis
}

// inParallel runs do(i) for i in [0, n) on workers goroutines and returns
// the errors, the first few of them described.
func inParallel(n, workers int, do func(i int) error) (failed int, firsts []string) {
	var mu sync.Mutex
	next := make(chan int)
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for i := range next {
				if err := do(i); err != nil {
					mu.Lock()
					if failed++; len(firsts) < 5 {
						firsts = append(firsts, fmt.Sprintf("call %d: %v", i, err))
					}
					mu.Unlock()
				}
			}
		})
	}
	for i := range n {
		next <- i
	}
	close(next)
	wg.Wait()
	return failed, firsts
}

// The server as built, under a load of concurrent charges that each wait
// for the provider inside their transaction: every call is answered, and
// the ledger holds exactly one row per key. Before the provider had a pool
// of its own, 16 calls at once took every connection of the default pool
// and waited for the provider, which waited for a connection.
func TestServerAnswersConcurrentChargesWithDefaultFlags(t *testing.T) {
	db := testdb.New(t, 2)
	lis := startDefault(t, db.URL())
	// A liveness bound only: a server that deadlocks fails here instead of
	// hanging the test binary.
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	client := paymentsv1.NewPaymentServiceClient(dial(t, lis.grpc))
	const accounts = 40
	require.Eventually(t, func() bool {
		_, err := client.GetBalance(ctx, &paymentsv1.GetBalanceRequest{AccountId: "warm-up"})
		return err == nil
	}, 10*time.Second, 20*time.Millisecond)

	t.Run("gRPC", func(t *testing.T) {
		const charges, concurrency = 2000, 16
		failed, firsts := inParallel(charges, concurrency, func(i int) error {
			_, err := client.Charge(idempotency.WithOutgoingKey(ctx, fmt.Sprintf("load-grpc-%d", i)),
				&paymentsv1.ChargeRequest{AccountId: fmt.Sprintf("grpc-%d", i%accounts), AmountCents: 1 + int64(i%7)})
			return err
		})
		require.Zero(t, failed, "%d of %d charges failed: %s", failed, charges, strings.Join(firsts, "; "))
		require.Equal(t, charges, db.Count(t, `SELECT count(*) FROM ledger WHERE account_id LIKE 'grpc-%'`))
		var want int64
		for i := range charges {
			want += 1 + int64(i%7)
		}
		require.EqualValues(t, want, db.Count(t, `SELECT sum(balance_cents) FROM accounts WHERE account_id LIKE 'grpc-%'`))

		const dups = 200
		ids := make([]string, dups)
		failed, firsts = inParallel(dups, dups, func(i int) error {
			resp, err := client.Charge(idempotency.WithOutgoingKey(ctx, "load-grpc-dup"), &paymentsv1.ChargeRequest{AccountId: "grpc-dup", AmountCents: 250})
			ids[i] = resp.GetChargeId()
			return err
		})
		require.Zero(t, failed, "%d of %d duplicates failed: %s", failed, dups, strings.Join(firsts, "; "))
		for _, id := range ids {
			require.Equal(t, ids[0], id, "every duplicate gets the one charge")
		}
		require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM ledger WHERE account_id = 'grpc-dup'`))
	})

	t.Run("HTTP", func(t *testing.T) {
		const charges, concurrency, dups = 500, 16, 100
		hc := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: dups}}
		defer hc.CloseIdleConnections()
		charge := func(key, account string, cents int64) (string, error) {
			req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+lis.http.Addr().String()+"/v1/charges",
				strings.NewReader(fmt.Sprintf(`{"account_id": %q, "amount_cents": %d}`, account, cents)))
			if err != nil {
				return "", err
			}
			req.Header.Set(idempotency.HeaderKey, key)
			req.Header.Set("Authorization", "Bearer demo-token-alice")
			resp, err := hc.Do(req)
			if err != nil {
				return "", err
			}
			defer resp.Body.Close()
			b, err := io.ReadAll(resp.Body)
			if err == nil && resp.StatusCode != http.StatusOK {
				err = fmt.Errorf("%s: %s", resp.Status, b)
			}
			return string(b), err
		}
		failed, firsts := inParallel(charges, concurrency, func(i int) error {
			_, err := charge(fmt.Sprintf("load-http-%d", i), fmt.Sprintf("http-%d", i%accounts), 3)
			return err
		})
		require.Zero(t, failed, "%d of %d charges failed: %s", failed, charges, strings.Join(firsts, "; "))
		require.Equal(t, charges, db.Count(t, `SELECT count(*) FROM ledger WHERE account_id LIKE 'http-%'`))
		require.EqualValues(t, 3*charges, db.Count(t, `SELECT sum(balance_cents) FROM accounts WHERE account_id LIKE 'http-%'`))

		bodies := make([]string, dups)
		failed, firsts = inParallel(dups, dups, func(i int) error {
			var err error
			bodies[i], err = charge("load-http-dup", "http-dup", 250)
			return err
		})
		require.Zero(t, failed, "%d of %d duplicates failed: %s", failed, dups, strings.Join(firsts, "; "))
		for _, b := range bodies {
			require.Equal(t, bodies[0], b, "every duplicate gets the one answer, byte for byte")
		}
		require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM ledger WHERE account_id = 'http-dup'`))
	})
	require.Equal(t, db.Count(t, `SELECT count(*) FROM ledger`), db.Count(t, `SELECT count(*) FROM provider_charges`),
		"the provider charged each executed charge once")
}

// Two replicas on one host, each with the default flags but for the
// addresses of its listeners (gRPC, HTTP, connect and metrics, each on a
// free port: with the defaults a second replica on one host cannot bind
// 127.0.0.1:50051, 8080, 8081 or 9464), start one after the other and
// charge on one database.
func TestTwoReplicasStartOnFreePorts(t *testing.T) {
	db := testdb.New(t, 1)
	for i := range 2 {
		// One after the other, as a rollout starts them: the first is
		// serving (it has migrated) when the second starts.
		lis := startDefault(t, db.URL())
		client := paymentsv1.NewPaymentServiceClient(dial(t, lis.grpc))
		key := fmt.Sprintf("replica-%d", i)
		require.Eventually(t, func() bool {
			_, err := client.Charge(idempotency.WithOutgoingKey(context.Background(), key), &paymentsv1.ChargeRequest{AccountId: key, AmountCents: 5})
			return err == nil
		}, 10*time.Second, 50*time.Millisecond, "replica %d charges", i)
	}
	require.Equal(t, 2, db.Count(t, `SELECT count(*) FROM ledger JOIN provider_charges ON provider_charges.id = ledger.provider_charge_id`))
}

// The pool is sized from -max-charges, in one place: a size in the URL is
// refused, not silently replaced.
func TestPoolIsSizedFromMaxCharges(t *testing.T) {
	pool, err := openPool(context.Background(), testdb.URL(), 7)
	require.NoError(t, err)
	require.EqualValues(t, 7, pool.Config().MaxConns)
	pool.Close()
	_, err = openPool(context.Background(), "postgres://127.0.0.1:5432/test?pool_max_conns=40", 7)
	require.ErrorContains(t, err, "size the pool with -max-charges")

	fs := flag.NewFlagSet("server", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	_, err = parseFlags(fs, []string{"-max-charges", "0"})
	require.Error(t, err)
}
