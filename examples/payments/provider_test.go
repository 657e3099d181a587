package payments_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/examples/payments"
	"github.com/exactlyonce/idempotency/examples/payments/outbox"
	paymentsv1 "github.com/exactlyonce/idempotency/examples/payments/proto/payments/v1"
	"github.com/exactlyonce/idempotency/examples/payments/provider"
	"github.com/exactlyonce/idempotency/internal/crashproc"
	"github.com/exactlyonce/idempotency/internal/faultproxy"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// The far side of a charge: the provider's own charges, counted against
// the ledger's rows, when the process between them dies at the worst
// moment and when the network loses responses on both hops.

// childEnv, when set, makes the test binary run as a process of these
// tests: a childConfig in JSON.
const childEnv = "PAYMENTS_PROVIDER_CHILD"

type childConfig struct {
	Role        string // "server": the PaymentService on fd 3; "worker": the outbox's worker
	DatabaseURL string
	ProviderURL string
	// KillAfterProvider kills the process with SIGKILL when the provider
	// has answered this many times (0: never), before the answer is
	// committed anywhere.
	KillAfterProvider int64
	// KillAfterSettle kills a worker with SIGKILL when it has settled this
	// many ledger rows (0: never), before River records the job's
	// completion.
	KillAfterSettle int64
}

func startChild(t *testing.T, c childConfig, files ...*os.File) *crashproc.Child {
	t.Helper()
	b, err := json.Marshal(c)
	require.NoError(t, err)
	return crashproc.Start(t, []string{childEnv + "=" + string(b)}, files...)
}

// runChild is a child process: a PaymentService that charges the provider
// inside its calls, or a worker of the outbox, either dying right after
// the provider's answer if told to.
func runChild() int {
	return crashproc.Main(func() error {
		var c childConfig
		if err := json.Unmarshal([]byte(os.Getenv(childEnv)), &c); err != nil {
			return fmt.Errorf("%s: %w", childEnv, err)
		}
		var answers atomic.Int64
		afterProvider := func(context.Context) {
			if answers.Add(1) == c.KillAfterProvider {
				crashproc.KillSelf()
			}
		}
		var settled atomic.Int64
		afterSettle := func(context.Context) {
			if settled.Add(1) == c.KillAfterSettle {
				crashproc.KillSelf()
			}
		}
		ctx := context.Background()
		pool, err := pgxpool.New(ctx, c.DatabaseURL)
		if err != nil {
			return err
		}
		defer pool.Close()
		client := &provider.Client{BaseURL: c.ProviderURL, Merchant: "test"} // the merchant of world.providerClient: one scope at the provider
		store, err := idempotency.NewStore(pool)
		if err != nil {
			return err
		}
		if c.Role == "worker" {
			ob, err := outbox.New(pool, outbox.Config{Provider: client, Store: store, RescueAfter: 2 * time.Second, RetryDelay: 100 * time.Millisecond, AfterProvider: afterProvider, AfterSettle: afterSettle})
			if err == nil {
				err = ob.Start(ctx)
			}
			if err != nil {
				return err
			}
			crashproc.Ready()
			select {}
		}
		lis, err := crashproc.Listener()
		if err != nil {
			return err
		}
		srv := payments.NewGRPCServer(payments.NewServer(pool, payments.WithProvider(client), payments.WithAfterProvider(afterProvider)), store)
		crashproc.Ready()
		return srv.Serve(lis)
	})
}

// world is the PaymentService's database and a provider with tables and a
// pool of its own, served over HTTP/2 (cleartext), optionally behind a
// network that drops responses after the provider committed.
type world struct {
	db          *testdb.DB
	store       *idempotency.Store
	providerURL string
	provider    struct{ executed, replayed atomic.Int64 }
	proxies     []*faultproxy.Proxy
}

func newWorld(t *testing.T, providerDrop float64) *world {
	t.Helper()
	ctx := context.Background()
	// 8 connections for the charges of 8 clients at once, and a few for
	// their steps, which commit the provider's answers on a connection of
	// their own while the call holds its: a pool that the calls hold whole
	// leaves the steps none.
	w := &world{db: testdb.New(t, 12)}
	var err error
	w.store, err = idempotency.NewStore(w.db.Pool)
	require.NoError(t, err)
	require.NoError(t, payments.Migrate(ctx, w.db.Pool, w.store))
	require.NoError(t, outbox.Migrate(ctx, w.db.Pool))

	pstore, err := provider.NewStore(w.db.OpenPool(t, 6), idempotency.WithTracer(endTracer(func(_ context.Context, d idempotency.TraceCallEndData) {
		switch d.Outcome {
		case idempotency.OutcomeExecuted:
			w.provider.executed.Add(1)
		case idempotency.OutcomeReplayed:
			w.provider.replayed.Add(1)
		}
	})))
	require.NoError(t, err)
	require.NoError(t, provider.Migrate(ctx, w.db.Pool, pstore))
	srv := httptest.NewUnstartedServer(provider.NewHandler(pstore))
	srv.Config.Protocols = new(http.Protocols)
	srv.Config.Protocols.SetHTTP1(true)
	srv.Config.Protocols.SetUnencryptedHTTP2(true)
	srv.Start()
	t.Cleanup(srv.Close)
	w.providerURL = srv.URL
	if providerDrop > 0 {
		w.providerURL = "http://" + w.proxy(t, srv.Listener.Addr().String(), providerDrop, 11)
	}
	return w
}

// proxy puts a network that drops a share of responses in front of addr.
func (w *world) proxy(t *testing.T, addr string, drop float64, seed int64) string {
	t.Helper()
	p, err := faultproxy.New(addr, faultproxy.WithSeed(seed), faultproxy.WithDropResponseRate(drop))
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	w.proxies = append(w.proxies, p)
	return p.Addr()
}

func (w *world) dropped() (n int64) {
	for _, p := range w.proxies {
		n += p.Stats().ResponsesDropped
	}
	return n
}

// providerClient speaks HTTP/2 without TLS, so that the fault proxy sees
// where each response starts.
func (w *world) providerClient(t *testing.T) *provider.Client {
	tr := http.DefaultTransport.(*http.Transport).Clone()
	t.Cleanup(tr.CloseIdleConnections)
	tr.Protocols = new(http.Protocols)
	tr.Protocols.SetUnencryptedHTTP2(true)
	return &provider.Client{BaseURL: w.providerURL, Merchant: "test", HTTP: &http.Client{Transport: &idempotency.HTTPTransport{Base: tr}, Timeout: 10 * time.Second}}
}

// counts are the provider's charges, the ledger's rows, and the rows that
// name a provider charge.
type counts struct{ providerCharges, ledgerRows, settled int }

func (w *world) counts(t *testing.T) counts {
	t.Helper()
	return counts{
		providerCharges: w.db.Count(t, `SELECT count(*) FROM provider_charges`),
		ledgerRows:      w.db.Count(t, `SELECT count(*) FROM ledger`),
		settled:         w.db.Count(t, `SELECT count(*) FROM ledger JOIN provider_charges ON provider_charges.id = ledger.provider_charge_id`),
	}
}

// waitSettled waits until n ledger rows name their provider charge.
func (w *world) waitSettled(t *testing.T, n int) {
	t.Helper()
	w.waitFor(t, fmt.Sprintf("%d ledger rows settled", n), func() bool { return w.counts(t).settled >= n })
}

// waitFor waits until done, for at most 3 minutes: the outbox works on
// its own schedule.
func (w *world) waitFor(t *testing.T, what string, done func() bool) {
	t.Helper()
	deadline := time.Now().Add(3 * time.Minute)
	for !done() {
		if time.Now().After(deadline) {
			t.Fatalf("not reached: %s; now %+v, jobs %v", what, w.counts(t), w.jobStates(t))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// deadWorkerOutlived does to River's tables what time does once a worker
// died holding a job: the dead worker's leadership lease runs out (River
// waits up to 15 s for it) and its job has been running longer than
// RescueAfter. The next worker then leads at once and its rescuer, which
// runs when it starts leading and every 30 s after, takes the job on its
// first run: the test waits on what the workers do, not on River's clocks.
func (w *world) deadWorkerOutlived(t *testing.T) {
	t.Helper()
	ctx := context.Background()
	_, err := w.db.Pool.Exec(ctx, `DELETE FROM river_leader`)
	require.NoError(t, err)
	_, err = w.db.Pool.Exec(ctx, `UPDATE river_job SET attempted_at = attempted_at - interval '1 hour' WHERE state = 'running'`)
	require.NoError(t, err)
}

func (w *world) jobStates(t *testing.T) map[string]int {
	t.Helper()
	rows, err := w.db.Pool.Query(context.Background(), `SELECT state::text, count(*) FROM river_job GROUP BY 1`)
	require.NoError(t, err)
	defer rows.Close()
	states := map[string]int{}
	for rows.Next() {
		var s string
		var n int
		require.NoError(t, rows.Scan(&s, &n))
		states[s] = n
	}
	require.NoError(t, rows.Err())
	return states
}

// serve serves svc with the store on a loopback port (behind a dropping
// network when drop > 0) and returns a client through the library's client interceptor.
func (w *world) serve(t *testing.T, svc *payments.Server, drop float64) paymentsv1.PaymentServiceClient {
	t.Helper()
	srv := payments.NewGRPCServer(svc, w.store)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	addr := lis.Addr().String()
	if drop > 0 {
		addr = w.proxy(t, addr, drop, 5)
	}
	return dialPayments(t, addr)
}

func dialPayments(t *testing.T, addr string) paymentsv1.PaymentServiceClient {
	t.Helper()
	conn, err := grpc.NewClient("passthrough:///"+addr,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithUnaryInterceptor(idempotency.UnaryClientInterceptor(
			idempotency.WithMaxAttempts(11), idempotency.WithRetryBackoff(10*time.Millisecond, 200*time.Millisecond))))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return paymentsv1.NewPaymentServiceClient(conn)
}

// chargeUntilDone makes one logical charge under key, sending it again
// with the same key while the error says a retry can help.
func chargeUntilDone(ctx context.Context, c paymentsv1.PaymentServiceClient, key string, req *paymentsv1.ChargeRequest) (*paymentsv1.ChargeResponse, error) {
	ctx = idempotency.WithOutgoingKey(ctx, key)
	for {
		resp, err := c.Charge(ctx, req)
		switch status.Code(err) {
		case codes.OK:
			return resp, nil
		case codes.Unavailable, codes.Aborted, codes.DeadlineExceeded, codes.ResourceExhausted:
			if ctx.Err() == nil {
				time.Sleep(20 * time.Millisecond)
				continue
			}
		}
		return nil, err
	}
}

func listenerFile(t *testing.T) (*os.File, string) {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = lis.Close() })
	f, err := lis.(*net.TCPListener).File()
	require.NoError(t, err)
	t.Cleanup(func() { _ = f.Close() })
	return f, lis.Addr().String()
}

// The PaymentService is killed (SIGKILL) after the provider charged (and
// its answer was recorded as the call's step) and before the call
// committed; the provider then forgets its keys, and the client sends the
// charge again with its key to the restarted service. The re-run takes the
// step's record and does not ask the provider, which would have taken the
// key as new and charged again: one provider charge, one ledger row,
// naming each other. The same when the restarted service charges through
// the outbox instead (a rolling switch to -outbox): the job carries the
// key and the scope of the first run's step, and its worker's step is that
// record.
func TestServerKilledAfterProviderAnsweredChargesOnce(t *testing.T) {
	// Not parallel: with its provider and child processes it needs about 30
	// of the server's connections, and the suite stays under its budget.
	for _, restart := range []string{"inside the call", "outbox"} {
		t.Run("restarted "+restart, func(t *testing.T) {
			w := newWorld(t, 0)
			lisFile, addr := listenerFile(t)
			cfg := childConfig{Role: "server", DatabaseURL: w.db.URL(), ProviderURL: w.providerURL, KillAfterProvider: 1}
			first := startChild(t, cfg, lisFile)
			client := dialPayments(t, addr)

			type result struct {
				resp *paymentsv1.ChargeResponse
				err  error
			}
			done := make(chan result, 1)
			go func() {
				ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
				defer cancel()
				resp, err := chargeUntilDone(ctx, client, "order-crash-1", &paymentsv1.ChargeRequest{AccountId: "acct-1", AmountCents: 700})
				done <- result{resp, err}
			}()
			first.RequireKilled(t, "after the provider answered")
			require.Equal(t, counts{providerCharges: 1}, w.counts(t), "the provider charged; the dead service committed nothing")
			w.expireProviderKeys(t)

			if restart == "outbox" {
				w.serveOutboxOn(t, lisFile)
			} else {
				cfg.KillAfterProvider = 0
				startChild(t, cfg, lisFile)
			}
			var r result
			select {
			case r = <-done:
			case <-time.After(3 * time.Minute):
				t.Fatal("the charge did not finish after the restart")
			}
			require.NoError(t, r.err)
			w.waitSettled(t, 1)
			require.Equal(t, counts{providerCharges: 1, ledgerRows: 1, settled: 1}, w.counts(t))
			require.EqualValues(t, 1, w.provider.executed.Load(), "the provider executed one charge")
			require.Zero(t, w.provider.replayed.Load(), "the re-run took the step's record and did not ask the provider")
			bal, n, err := payments.Balance(context.Background(), w.db.Pool, "acct-1")
			require.NoError(t, err)
			require.EqualValues(t, 700, bal)
			require.EqualValues(t, 1, n)
			require.EqualValues(t, 700, r.resp.GetBalanceCents())
		})
	}
}

// The provider refuses a charge's key when the service sends it other
// bytes for the charge than the run before did: here a deploy between the
// two runs changed the request's Content-Type. The fault is the service's,
// never the customer's, and the provider may have made the first charge:
// the call answers Internal and keeps no answer under its key, and once
// the change is undone the charge sent again gets the provider's first
// charge. Before, the refusal was FailedPrecondition, which the key kept
// as its answer for good: a failure, for money that had moved. The first
// run loses the provider's answer before its step records it (the window
// a step leaves): a recorded answer would serve the re-runs without
// asking the provider.
func TestChangedProviderRequestLeavesTheKeyFree(t *testing.T) {
	w := newWorld(t, 0)
	redeploy := &redeployedTransport{base: http.DefaultTransport}
	svc := payments.NewServer(w.db.Pool, payments.WithProvider(&provider.Client{BaseURL: w.providerURL, Merchant: "test",
		HTTP: &http.Client{Transport: redeploy, Timeout: 10 * time.Second}}))
	client := w.serve(t, svc, 0)
	ctx := context.Background()
	const key = "order-redeploy"
	req := &paymentsv1.ChargeRequest{AccountId: "acct-1", AmountCents: 700}

	// The first run: the provider charges, and its answer never comes
	// back; the call is cancelled while it waits, and rolls back, its step
	// unrecorded.
	redeploy.hang.Store(true)
	callCtx, cancel := context.WithCancel(idempotency.WithOutgoingKey(ctx, key))
	defer cancel()
	done := make(chan error, 1)
	go func() { _, err := client.Charge(callCtx, req); done <- err }()
	w.waitFor(t, "the provider charged", func() bool { return redeploy.hung.Load() == 1 })
	require.Equal(t, counts{providerCharges: 1}, w.counts(t), "the provider charged; the call has committed nothing")
	cancel()
	require.Equal(t, codes.Canceled.String(), status.Code(<-done).String())
	redeploy.hang.Store(false)

	redeploy.changed.Store(true)
	for range 2 {
		_, err := chargeUntilDone(ctx, client, key, req)
		require.Equal(t, codes.Internal.String(), status.Code(err).String(), "the service's fault, not the customer's: %v", err)
		require.Contains(t, status.Convert(err).Message(), "look the key up at the provider")
	}
	require.Equal(t, counts{providerCharges: 1}, w.counts(t))

	redeploy.changed.Store(false)
	resp, err := chargeUntilDone(ctx, client, key, req)
	require.NoError(t, err, "the change undone, the charge sent again gets the provider's first charge")
	require.EqualValues(t, 700, resp.GetBalanceCents())
	require.Equal(t, counts{providerCharges: 1, ledgerRows: 1, settled: 1}, w.counts(t))
	require.EqualValues(t, 1, w.provider.executed.Load())
}

// redeployedTransport sends the provider's requests, once changed, as a
// deploy that changed their encoding would: the same charge, with another
// Content-Type. While hang is set it loses the provider's answers: it
// waits, once the provider answered, until the request is cancelled
// (hung counts those answers).
type redeployedTransport struct {
	base          http.RoundTripper
	changed, hang atomic.Bool
	hung          atomic.Int64
}

func (t *redeployedTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	if t.changed.Load() {
		r = r.Clone(r.Context())
		r.Header.Set("Content-Type", "application/json; charset=utf-8")
	}
	resp, err := t.base.RoundTrip(r)
	if err != nil || !t.hang.Load() {
		return resp, err
	}
	_ = resp.Body.Close()
	t.hung.Add(1)
	<-r.Context().Done()
	return nil, r.Context().Err()
}

// serveOutboxOn serves, in this process, a PaymentService that charges
// through the outbox, on the listening socket lisFile, with a worker.
func (w *world) serveOutboxOn(t *testing.T, lisFile *os.File) {
	t.Helper()
	lis, err := net.FileListener(lisFile)
	require.NoError(t, err)
	srv := payments.NewGRPCServer(payments.NewServer(w.db.Pool, payments.WithOutbox(w.startOutbox(t))), w.store)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
}

// startOutbox starts the outbox with a worker in this process, stopped
// when t ends.
func (w *world) startOutbox(t *testing.T) *outbox.Outbox {
	t.Helper()
	return w.startOutboxWith(t, outbox.Config{RetryDelay: 20 * time.Millisecond})
}

// The outbox's worker is killed (SIGKILL) after the provider charged (and
// its answer was recorded as the job's step) and before it settled the
// ledger row. The provider then forgets its keys, and River finds the job
// stuck and runs it on the next worker, which takes the step's record and
// does not ask the provider (that would have taken the key as new and
// charged again): one provider charge, one settled ledger row.
func TestWorkerKilledAfterProviderAnsweredChargesOnce(t *testing.T) {
	// Not parallel: with its provider and child processes it needs about 30
	// of the server's connections, and the suite stays under its budget.
	w := newWorld(t, 0)
	enqueue, err := outbox.New(w.db.Pool, outbox.Config{})
	require.NoError(t, err)
	client := w.serve(t, payments.NewServer(w.db.Pool, payments.WithOutbox(enqueue)), 0)
	_, err = chargeUntilDone(context.Background(), client, "order-outbox-crash-1", &paymentsv1.ChargeRequest{AccountId: "acct-1", AmountCents: 300})
	require.NoError(t, err)
	require.Equal(t, counts{ledgerRows: 1}, w.counts(t), "the call committed its row and its job, nothing charged yet")

	cfg := childConfig{Role: "worker", DatabaseURL: w.db.URL(), ProviderURL: w.providerURL, KillAfterProvider: 1}
	startChild(t, cfg).RequireKilled(t, "after the provider answered")
	require.Equal(t, counts{providerCharges: 1, ledgerRows: 1}, w.counts(t), "the provider charged; the dead worker settled nothing")
	w.deadWorkerOutlived(t)
	w.expireProviderKeys(t)

	cfg.KillAfterProvider = 0
	startChild(t, cfg)
	w.waitFor(t, "the rescued job settled its row, or charged again", func() bool {
		c := w.counts(t)
		return c.settled >= 1 || c.providerCharges > 1
	})
	require.Equal(t, counts{providerCharges: 1, ledgerRows: 1, settled: 1}, w.counts(t))
	require.EqualValues(t, 1, w.provider.executed.Load())
	require.Zero(t, w.provider.replayed.Load(), "the rescued job took the step's record and did not ask the provider")
}

// 200 charges from 8 clients, both ways to the provider, while the network
// drops 20% of responses after they were committed, on the way back from
// the PaymentService and on the way back from the provider: provider
// charges = ledger rows = 200, each row naming its own provider charge.
func TestTwoHundredChargesUnderDroppedResponses(t *testing.T) {
	// Not parallel: with its provider and child processes it needs about 30
	// of the server's connections, and the suite stays under its budget.
	const charges, clients, drop = 200, 8, 0.2
	for _, path := range []string{"inside the call", "outbox"} {
		t.Run(path, func(t *testing.T) {
			w := newWorld(t, drop)
			var svc *payments.Server
			if path == "outbox" {
				svc = payments.NewServer(w.db.Pool, payments.WithOutbox(w.startOutbox(t)))
			} else {
				svc = payments.NewServer(w.db.Pool, payments.WithProvider(w.providerClient(t)))
			}
			client := w.serve(t, svc, drop)

			var next atomic.Int64
			var wg sync.WaitGroup
			errs := make(chan error, charges)
			for range clients {
				wg.Go(func() {
					for i := next.Add(1); i <= charges; i = next.Add(1) {
						ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
						_, err := chargeUntilDone(ctx, client, fmt.Sprintf("order-%d", i), &paymentsv1.ChargeRequest{AccountId: fmt.Sprintf("acct-%d", i%5), AmountCents: 100 + i})
						cancel()
						if err != nil {
							errs <- fmt.Errorf("charge %d: %w", i, err)
						}
					}
				})
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Error(err)
			}
			w.waitSettled(t, charges)
			require.Equal(t, counts{providerCharges: charges, ledgerRows: charges, settled: charges}, w.counts(t))
			require.EqualValues(t, charges, w.provider.executed.Load())
			if path == "outbox" {
				// River records completions in batches, shortly after the work.
				w.waitFor(t, "every job completed; none cancelled or discarded", func() bool {
					states := w.jobStates(t)
					return len(states) == 1 && states["completed"] == charges
				})
			}
			require.Positive(t, w.dropped(), "the network dropped responses")
			t.Logf("%s: %d charges, %d responses dropped, %d provider replays", path, charges, w.dropped(), w.provider.replayed.Load())
		})
	}
}

// endTracer is an idempotency.Tracer that only looks at the end of each
// call.
type endTracer func(ctx context.Context, data idempotency.TraceCallEndData)

func (f endTracer) TraceCallStart(ctx context.Context, _ idempotency.TraceCallStartData) context.Context {
	return ctx
}

func (f endTracer) TraceCallEnd(ctx context.Context, data idempotency.TraceCallEndData) { f(ctx, data) }
