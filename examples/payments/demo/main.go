// Command demo shows exactly-once charges over a network that loses
// responses after the server committed them, down to the payment provider
// where the money moves.
//
//	go -C examples/payments run ./demo     (at the repository's root)
//
// It starts two PaymentService replicas on one PostgreSQL database, each
// behind a fault proxy that drops a share of responses after the server
// committed, and spreads hundreds of charges from concurrent clients over
// them. Each charge first charges the example's payment provider (its own
// HTTP service and tables, behind its own faulty network), with a key
// derived from the call's, as a step of the call (idempotency.Step: the
// provider's answer is recorded in a commit of its own). The provider
// forgets every key a few seconds after it saw it (-provider-forget). Some
// charges are sent twice at once with the same key, one replica is
// restarted midway, and twice a replica crashes right after the provider
// answered, before its commit, once the provider has forgotten the key:
// the re-run takes the step's record, where asking the provider again
// would charge twice. At the end it compares every account's balance and
// the provider's charges with what was requested and exits non-zero on
// any difference.
package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/google/uuid"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/retry"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/resolver"
	"google.golang.org/grpc/resolver/manual"
	"google.golang.org/grpc/status"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/examples/payments"
	paymentsv1 "github.com/exactlyonce/idempotency/examples/payments/proto/payments/v1"
	"github.com/exactlyonce/idempotency/examples/payments/provider"
	"github.com/exactlyonce/idempotency/internal/dburl"
	"github.com/exactlyonce/idempotency/internal/faultproxy"
)

type config struct {
	databaseURL  string
	charges      int
	clients      int
	accounts     int
	dropRate     float64
	providerDrop float64
	dupEvery     int
	// providerForget is how long the provider keeps a key (0: the
	// library's default, 24 hours).
	providerForget time.Duration
	seed           int64
	keep           bool
	progress       time.Duration // 0: no progress lines
}

func main() {
	var c config
	flag.StringVar(&c.databaseURL, "database-url", "", dburl.Usage())
	flag.IntVar(&c.charges, "charges", 300, "logical charges to make")
	flag.IntVar(&c.clients, "clients", 8, "concurrent clients")
	flag.IntVar(&c.accounts, "accounts", 5, "accounts to spread the charges over")
	flag.Float64Var(&c.dropRate, "drop", 0.25, "share of responses the network loses after the server committed")
	flag.Float64Var(&c.providerDrop, "provider-drop", 0.1, "share of the provider's responses the network loses after the provider committed")
	flag.IntVar(&c.dupEvery, "dup-every", 10, "send every n-th charge twice at once with the same key (0: never)")
	flag.DurationVar(&c.providerForget, "provider-forget", 3*time.Second, "how long the provider keeps each key; a crashed replica dies only once its charge's key is forgotten (0: the provider keeps keys 24 hours)")
	flag.Int64Var(&c.seed, "seed", 1, "seed of the network faults: which charges are sent twice, and the drop draws (which attempts they hit depends on timing)")
	flag.BoolVar(&c.keep, "keep", false, "keep the demo's database schema for inspection")
	flag.DurationVar(&c.progress, "progress", 500*time.Millisecond, "interval of progress lines (0: none)")
	flag.Parse()
	if c.databaseURL == "" {
		c.databaseURL = dburl.URL()
	}

	rep, err := run(context.Background(), c, os.Stdout)
	if err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		os.Exit(2)
	}
	if !rep.ok() {
		os.Exit(1)
	}
}

// report is what the demo observed.
type report struct {
	providerForget                                time.Duration
	charges, duplicatesSent, restarts             int
	attempts, retries, appRetries                 int64
	executed, replayed, inProgress, mismatch      int64
	dropped, providerDropped, crashes             int64
	providerCharges, providerReplays, settled     int64
	failed                                        []string
	accounts                                      []accountResult
	executionsMatchCharges, responsesMatchCharges bool
}

type accountResult struct {
	id                         string
	expected, actual           int64
	expectedCharges, ledgerRow int64
}

func (r *report) ok() bool {
	if len(r.failed) > 0 || !r.executionsMatchCharges || !r.responsesMatchCharges || !r.providerMatchesCharges() {
		return false
	}
	for _, a := range r.accounts {
		if a.expected != a.actual || a.expectedCharges != a.ledgerRow {
			return false
		}
	}
	return true
}

// providerMatchesCharges: the provider charged each charge once, and each
// ledger row names its own provider charge.
func (r *report) providerMatchesCharges() bool {
	return r.providerCharges == int64(r.charges) && r.settled == int64(r.charges)
}

// replica is one server instance; restart stops it hard (calls in flight
// are cut) and starts a new one on the same address.
type replica struct {
	addr  string
	mu    sync.Mutex
	srv   *grpc.Server
	start func() (*grpc.Server, error)
}

func (r *replica) restart() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.srv.Stop()
	srv, err := r.start()
	if err != nil {
		return err
	}
	r.srv = srv
	return nil
}

func (r *replica) stop() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.srv.Stop()
}

func run(ctx context.Context, c config, out io.Writer) (*report, error) {
	// The crashing replicas print from their calls' goroutines, while the
	// demo prints its own progress.
	out = &lockedWriter{w: out}
	if c.charges <= 0 || c.clients <= 0 || c.accounts <= 0 || c.dropRate < 0 || c.dropRate >= 1 || c.providerDrop < 0 || c.providerDrop >= 1 || c.providerForget < 0 {
		return nil, errors.New("need -charges, -clients, -accounts > 0, 0 <= -drop < 1, 0 <= -provider-drop < 1 and -provider-forget >= 0")
	}
	pool, providerPool, cleanup, err := openDemoDB(ctx, c, out)
	if err != nil {
		return nil, err
	}
	defer cleanup()
	rep := &report{charges: c.charges, providerForget: c.providerForget}
	var attempts, executed, replayed, inProgress, mismatch atomic.Int64
	count := endTracer(func(_ context.Context, data idempotency.TraceCallEndData) {
		switch data.Outcome {
		case idempotency.OutcomeExecuted:
			executed.Add(1)
		case idempotency.OutcomeReplayed:
			replayed.Add(1)
		case idempotency.OutcomeInProgress:
			inProgress.Add(1)
		case idempotency.OutcomeKeyReused:
			mismatch.Add(1)
		}
	})
	store, err := idempotency.NewStore(pool, idempotency.WithTracer(count),
		// Short, so that duplicates sent at once show up as in-progress
		// conflicts that the client retries, rather than only as waits.
		idempotency.WithInProgressWait(10*time.Millisecond), idempotency.WithSuggestedRetryDelay(25*time.Millisecond))
	if err != nil {
		return nil, err
	}
	if err := payments.Migrate(ctx, pool, store); err != nil {
		return nil, err
	}
	prov, err := startProvider(ctx, providerPool, c, rep)
	if err != nil {
		return nil, err
	}
	defer prov.close()
	arrivals := func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		attempts.Add(1)
		return h(ctx, req)
	}

	// Two replicas on one database, each behind its own faulty network.
	// Twice, a replica crashes right after the provider answered (and the
	// call's step recorded the answer), before the call commits, and only
	// once the provider has forgotten the charge's key: the re-run finds
	// the answer in the step's record, as it must when it comes hours
	// later.
	var failMu sync.Mutex
	fail := func(format string, args ...any) {
		failMu.Lock()
		defer failMu.Unlock()
		rep.failed = append(rep.failed, fmt.Sprintf(format, args...))
	}
	var replicas []*replica
	var answers, crashes atomic.Int64
	crashAt := map[int64]bool{int64(c.charges) / 4: true, int64(c.charges) * 3 / 4: true}
	crash := func(r int) func(context.Context) {
		return func(ctx context.Context) {
			if !crashAt[answers.Add(1)] {
				return
			}
			crashes.Add(1)
			if c.providerForget > 0 {
				time.Sleep(c.providerForget + 500*time.Millisecond)
			}
			fmt.Fprintf(out, "  -- replica %d crashes after the provider answered, before its commit, the provider having forgotten the key --\n", r)
			// What a dead process leaves: its database session gone, with the
			// transaction that held the ledger row, the key and the provider's
			// answer; its calls in flight cut.
			_, _ = idempotency.MustTxFromContext(ctx).Exec(ctx, "SELECT pg_terminate_backend(pg_backend_pid())")
			go func() {
				if err := replicas[r].restart(); err != nil {
					fail("restart replica %d after its crash: %v", r, err)
				}
			}()
		}
	}
	var proxies []*faultproxy.Proxy
	defer func() {
		for _, p := range proxies {
			_ = p.Close()
		}
		for _, r := range replicas {
			r.stop()
		}
	}()
	var addrs []resolver.Address
	for i := 0; i < 2; i++ {
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		r := &replica{addr: lis.Addr().String()}
		r.start = func() (*grpc.Server, error) {
			srv := grpc.NewServer(grpc.ChainUnaryInterceptor(arrivals,
				idempotency.UnaryServerInterceptor(store)))
			paymentsv1.RegisterPaymentServiceServer(srv, payments.NewServer(pool, payments.WithProvider(prov.client), payments.WithAfterProvider(crash(i))))
			l := lis
			if l == nil {
				var err error
				if l, err = listenRetrying(r.addr); err != nil {
					return nil, err
				}
			}
			lis = nil
			go func() { _ = srv.Serve(l) }()
			return srv, nil
		}
		if r.srv, err = r.start(); err != nil {
			return nil, err
		}
		replicas = append(replicas, r)
		p, err := faultproxy.New(r.addr, faultproxy.WithSeed(c.seed+int64(i)), faultproxy.WithDropResponseRate(c.dropRate))
		if err != nil {
			return nil, err
		}
		proxies = append(proxies, p)
		addrs = append(addrs, resolver.Address{Addr: p.Addr()})
	}

	// One client connection, round robin over both replicas, with the
	// library's client interceptor: one key per charge, retried under it.
	res := manual.NewBuilderWithScheme("demo")
	res.InitialState(resolver.State{Addresses: addrs})
	conn, err := grpc.NewClient(res.Scheme()+":///payments",
		grpc.WithResolvers(res),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultServiceConfig(`{"loadBalancingConfig": [{"round_robin": {}}]}`),
		grpc.WithUnaryInterceptor(idempotency.UnaryClientInterceptor(
			idempotency.WithMaxAttempts(21), idempotency.WithRetryBackoff(10*time.Millisecond, 500*time.Millisecond))),
	)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	client := paymentsv1.NewPaymentServiceClient(conn)

	fmt.Fprintf(out, "demo: %d charges from %d clients over %d accounts; 2 replicas on one database, each charging a payment provider first, as a step of the call; the provider forgets each key after %v; the network drops %.0f%% of responses after commit (%.0f%% of the provider's); every %d-th charge is sent twice at once; replica 1 restarts halfway; twice a replica crashes between the provider's answer and its commit\n\n",
		c.charges, c.clients, c.accounts, forgetText(c.providerForget), c.dropRate*100, c.providerDrop*100, c.dupEvery)

	expected := map[string]*accountResult{}
	for a := 0; a < c.accounts; a++ {
		id := fmt.Sprintf("acct-%d", a+1)
		expected[id] = &accountResult{id: id}
	}
	type job struct {
		i       int
		account string
		amount  int64
		twice   bool
	}
	jobs := make(chan job)
	var done, retries, appRetries atomic.Int64
	var wrongResponses atomic.Int64
	onRetry := retry.WithOnRetryCallback(func(context.Context, uint, error) { retries.Add(1) })

	// charge makes one logical charge with key, retrying beyond the interceptor's
	// retries with the same key if it has to.
	charge := func(j job, key string) *paymentsv1.ChargeResponse {
		ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
		defer cancel()
		ctx = idempotency.WithOutgoingKey(ctx, key)
		req := &paymentsv1.ChargeRequest{AccountId: j.account, AmountCents: j.amount}
		for {
			resp, err := client.Charge(ctx, req, onRetry)
			if err == nil {
				return resp
			}
			if ctx.Err() != nil || !retryable(err) {
				fail("charge %d: %v", j.i, err)
				return nil
			}
			appRetries.Add(1)
			time.Sleep(50 * time.Millisecond)
		}
	}
	var wg sync.WaitGroup
	for w := 0; w < c.clients; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := range jobs {
				key := uuid.Must(uuid.NewV7()).String()
				senders := 1
				if j.twice {
					senders = 2
				}
				resps := make([]*paymentsv1.ChargeResponse, senders)
				var sw sync.WaitGroup
				for s := range resps {
					sw.Add(1)
					go func() { defer sw.Done(); resps[s] = charge(j, key) }()
				}
				sw.Wait()
				for _, r := range resps {
					if r != nil && (r.GetAccountId() != j.account || r.GetAmountCents() != j.amount || r.GetChargeId() != resps[0].GetChargeId()) {
						wrongResponses.Add(1)
					}
				}
				done.Add(1)
			}
		}()
	}

	stopProgress := make(chan struct{})
	progressDone := make(chan struct{})
	go func() {
		defer close(progressDone)
		if c.progress <= 0 {
			<-stopProgress
			return
		}
		t := time.NewTicker(c.progress)
		defer t.Stop()
		for {
			select {
			case <-stopProgress:
				return
			case <-t.C:
				fmt.Fprintf(out, "  %4d/%d charges   %5d attempts   %4d retries   %4d replays   %4d dropped responses\n",
					done.Load(), c.charges, attempts.Load(), retries.Load(), replayed.Load(), dropped(proxies))
			}
		}
	}()

	for i := 0; i < c.charges; i++ {
		a := expected[fmt.Sprintf("acct-%d", i%c.accounts+1)]
		j := job{i: i, account: a.id, amount: int64(100 + 25*(i%7)), twice: c.dupEvery > 0 && i%c.dupEvery == c.dupEvery-1}
		a.expected += j.amount
		a.expectedCharges++
		if j.twice {
			rep.duplicatesSent++
		}
		if i == c.charges/2 {
			go func() {
				if err := replicas[1].restart(); err != nil {
					fail("restart replica 1: %v", err)
				}
			}()
			rep.restarts++
			fmt.Fprintln(out, "  -- replica 1 restarts (calls in flight on it are cut) --")
		}
		jobs <- j
	}
	close(jobs)
	wg.Wait()
	close(stopProgress)
	<-progressDone

	rep.attempts, rep.retries, rep.appRetries = attempts.Load(), retries.Load(), appRetries.Load()
	rep.executed, rep.replayed, rep.inProgress, rep.mismatch = executed.Load(), replayed.Load(), inProgress.Load(), mismatch.Load()
	rep.dropped = dropped(proxies)
	rep.crashes = crashes.Load()
	if err := prov.count(ctx, pool, rep); err != nil {
		return nil, err
	}
	rep.executionsMatchCharges = rep.executed == int64(c.charges)
	rep.responsesMatchCharges = wrongResponses.Load() == 0
	ids := make([]string, 0, len(expected))
	for id := range expected {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	for _, id := range ids {
		a := expected[id]
		if a.actual, a.ledgerRow, err = payments.Balance(ctx, pool, id); err != nil {
			return nil, err
		}
		rep.accounts = append(rep.accounts, *a)
	}
	rep.print(out)
	return rep, nil
}

// demoProvider is the payment provider of the demo: its own HTTP server
// (HTTP/2 without TLS, so that its fault proxy sees each response), its
// own store and tables, behind a network that drops a share of its
// responses after it committed.
type demoProvider struct {
	client   *provider.Client
	http     *http.Server
	proxy    *faultproxy.Proxy
	replayed atomic.Int64
	idle     func()
}

func startProvider(ctx context.Context, pool *pgxpool.Pool, c config, rep *report) (*demoProvider, error) {
	p := &demoProvider{}
	store, err := provider.NewStore(pool, idempotency.WithTracer(endTracer(func(_ context.Context, d idempotency.TraceCallEndData) {
		if d.Outcome == idempotency.OutcomeReplayed {
			p.replayed.Add(1)
		}
	})))
	if err != nil {
		return nil, err
	}
	if err := provider.Migrate(ctx, pool, store); err != nil {
		return nil, err
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	var opts []provider.HandlerOption
	if c.providerForget > 0 {
		opts = append(opts, provider.WithKeyTTL(c.providerForget))
	}
	p.http = &http.Server{Handler: provider.NewHandler(store, opts...), ReadHeaderTimeout: 10 * time.Second, Protocols: new(http.Protocols)}
	p.http.Protocols.SetHTTP1(true)
	p.http.Protocols.SetUnencryptedHTTP2(true)
	go func() { _ = p.http.Serve(lis) }()
	if p.proxy, err = faultproxy.New(lis.Addr().String(), faultproxy.WithSeed(c.seed+100), faultproxy.WithDropResponseRate(c.providerDrop)); err != nil {
		_ = p.http.Close()
		return nil, err
	}
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.Protocols = new(http.Protocols)
	tr.Protocols.SetUnencryptedHTTP2(true)
	p.idle = tr.CloseIdleConnections
	p.client = &provider.Client{BaseURL: "http://" + p.proxy.Addr(), Merchant: "payments-demo",
		HTTP: &http.Client{Transport: &idempotency.HTTPTransport{Base: tr}, Timeout: 10 * time.Second}}
	return p, nil
}

// count reads what the provider did into rep.
func (p *demoProvider) count(ctx context.Context, pool *pgxpool.Pool, rep *report) error {
	rep.providerDropped = p.proxy.Stats().ResponsesDropped
	rep.providerReplays = p.replayed.Load()
	return pool.QueryRow(ctx, `
SELECT (SELECT count(*) FROM provider_charges),
       (SELECT count(*) FROM ledger JOIN provider_charges ON provider_charges.id = ledger.provider_charge_id)`).Scan(&rep.providerCharges, &rep.settled)
}

func (p *demoProvider) close() {
	_ = p.proxy.Close()
	_ = p.http.Close()
	p.idle()
}

// forgetText is how long the provider keeps a key, as the report says it.
func forgetText(d time.Duration) string {
	if d <= 0 {
		return "24h (the default)"
	}
	return d.String()
}

func retryable(err error) bool {
	switch status.Code(err) {
	case codes.Unavailable, codes.Aborted, codes.ResourceExhausted, codes.DeadlineExceeded:
		return true
	}
	return false
}

func dropped(ps []*faultproxy.Proxy) int64 {
	var n int64
	for _, p := range ps {
		n += p.Stats().ResponsesDropped
	}
	return n
}

// listenRetrying binds addr again after a restart; the old listener's port
// can take a moment to be free.
func listenRetrying(addr string) (net.Listener, error) {
	var err error
	for i := 0; i < 50; i++ {
		var l net.Listener
		if l, err = net.Listen("tcp", addr); err == nil {
			return l, nil
		}
		time.Sleep(20 * time.Millisecond)
	}
	return nil, err
}

func (r *report) print(out io.Writer) {
	fmt.Fprintln(out)
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	row := func(name string, v any) { fmt.Fprintf(tw, "%s\t%v\t\n", name, v) }
	row("logical charges", r.charges)
	row("  of which sent twice at once", r.duplicatesSent)
	row("attempts reaching a server", r.attempts)
	row("client retries (retry interceptor)", r.retries)
	row("application retries (same key)", r.appRetries)
	row("responses dropped after commit", r.dropped)
	row("replica restarts", r.restarts)
	row("crashes after the provider answered", r.crashes)
	row("provider forgets each key after", forgetText(r.providerForget))
	row("provider responses dropped", r.providerDropped)
	row("provider replays (same derived key)", r.providerReplays)
	row("provider charges", r.providerCharges)
	row("ledger rows naming their provider charge", r.settled)
	row("handler executions (committed)", r.executed)
	row("replays from the store", r.replayed)
	row("in-progress conflicts (Aborted)", r.inProgress)
	row("key mismatches", r.mismatch)
	_ = tw.Flush()

	fmt.Fprintln(out)
	tw = tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "account\texpected cents\tactual cents\texpected charges\tledger rows\t\t\n")
	for _, a := range r.accounts {
		mark := "ok"
		if a.expected != a.actual || a.expectedCharges != a.ledgerRow {
			mark = "WRONG"
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%s\t\n", a.id, a.expected, a.actual, a.expectedCharges, a.ledgerRow, mark)
	}
	_ = tw.Flush()
	fmt.Fprintln(out)
	for _, f := range r.failed {
		fmt.Fprintln(out, "failed:", f)
	}
	if r.ok() {
		fmt.Fprintf(out, "verdict: PASS - %d charges, each executed exactly once despite %d lost responses, %d retries, a replica restart and %d crashes between the provider's answer and the commit, with a provider that forgets each key after %v; %d provider charges for %d ledger rows, one provider charge per charge; every account charged exactly what was requested\n",
			r.charges, r.dropped+r.providerDropped, r.retries+r.appRetries, r.crashes, forgetText(r.providerForget), r.providerCharges, r.settled)
		return
	}
	var why []string
	if !r.executionsMatchCharges {
		why = append(why, fmt.Sprintf("%d executions for %d charges", r.executed, r.charges))
	}
	if !r.providerMatchesCharges() {
		why = append(why, fmt.Sprintf("%d provider charges and %d ledger rows naming one, for %d charges", r.providerCharges, r.settled, r.charges))
	}
	if !r.responsesMatchCharges {
		why = append(why, "a client got a response that does not match its charge")
	}
	if len(r.failed) > 0 {
		why = append(why, fmt.Sprintf("%d charges failed", len(r.failed)))
	}
	fmt.Fprintf(out, "verdict: FAIL - accounts were not charged exactly what was requested (%s)\n", strings.Join(why, "; "))
}

// openDemoDB connects and creates a fresh schema for this run, so runs never
// see each other's data. cleanup drops it unless -keep.
func openDemoDB(ctx context.Context, c config, out io.Writer) (pool, providerPool *pgxpool.Pool, cleanup func(), err error) {
	cfg, err := pgxpool.ParseConfig(c.databaseURL)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("-database-url: %w", err)
	}
	pingCtx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	admin, err := pgxpool.NewWithConfig(pingCtx, cfg.Copy())
	if err == nil {
		err = admin.Ping(pingCtx)
	}
	if err != nil {
		if admin != nil {
			admin.Close()
		}
		return nil, nil, nil, fmt.Errorf(`cannot reach PostgreSQL at %s:%d/%s: %v

The demo needs a real PostgreSQL database (it never falls back to memory).
Point it at one with -database-url or the %s environment variable, or
start the local server. At the repository's root:
  DATABASE_URL=postgres://user:pass@host:5432/db go -C examples/payments run ./demo
  bash scripts/services.sh && go -C examples/payments run ./demo`,
			cfg.ConnConfig.Host, cfg.ConnConfig.Port, cfg.ConnConfig.Database, err, dburl.EnvVar)
	}
	var b [4]byte
	_, _ = rand.Read(b[:])
	schema := "payments_demo_" + hex.EncodeToString(b[:])
	dropSchema := func() {
		if c.keep {
			fmt.Fprintf(out, "kept schema %s\n", schema)
		} else {
			_, _ = admin.Exec(context.Background(), "DROP SCHEMA "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
		}
		admin.Close()
	}
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize()); err != nil {
		admin.Close()
		return nil, nil, nil, err
	}
	// The service and the provider each have a pool of their own: a call
	// holds its connection while it waits for the provider. Duplicates
	// sent at once double the calls in flight, and each call's step
	// commits the provider's answer on a connection of its own, for a
	// moment, while the call holds its.
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	pcfg := cfg.Copy()
	cfg.MaxConns, pcfg.MaxConns = int32(2*c.clients+4), int32(c.clients+4)
	if pool, err = pgxpool.NewWithConfig(ctx, cfg); err == nil {
		if providerPool, err = pgxpool.NewWithConfig(ctx, pcfg); err != nil {
			pool.Close()
		}
	}
	if err != nil {
		dropSchema()
		return nil, nil, nil, err
	}
	return pool, providerPool, func() {
		pool.Close()
		providerPool.Close()
		dropSchema()
	}, nil
}

// endTracer is an idempotency.Tracer that only looks at the end of each
// call.
type endTracer func(ctx context.Context, data idempotency.TraceCallEndData)

func (f endTracer) TraceCallStart(ctx context.Context, _ idempotency.TraceCallStartData) context.Context {
	return ctx
}

func (f endTracer) TraceCallEnd(ctx context.Context, data idempotency.TraceCallEndData) { f(ctx, data) }

// lockedWriter serializes the writes of goroutines to one writer.
type lockedWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(b []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(b)
}
