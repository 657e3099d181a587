// Command server runs the example PaymentService with the idempotency
// interceptor on PostgreSQL, over gRPC and, on the same store and business
// code, as JSON over HTTP, with its metrics for Prometheus. Each charge is
// charged at the example's payment provider too: inside the call, or with
// -outbox by a River worker after the call committed, either way as a step
// whose record keeps the provider's answer, so that a re-run or a retried
// job does not depend on the provider still knowing the key.
//
//	go -C examples/payments run ./server -addr 127.0.0.1:50051 -http-addr 127.0.0.1:8080 -metrics-addr 127.0.0.1:9464 -database-url "$DATABASE_URL"
//
// Without -provider-url it serves the provider itself, on -provider-addr
// (its own HTTP server, pool, key table and charges table, in the same
// database), a free port by default, so that replicas on one host start
// with the same flags.
//
// Its pool has -max-charges connections for charges, and a few more for
// everything else: a charge holds its connection while it waits for the
// provider.
//
// It migrates its tables on start, registers gRPC server reflection (so
// grpcurl can list and call it), logs one structured line per keyed call,
// serves the store's OpenTelemetry metrics at GET /metrics in Prometheus's
// text format, and shuts down gracefully on SIGINT or SIGTERM.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	otelprometheus "go.opentelemetry.io/otel/exporters/prometheus"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"google.golang.org/grpc"
	"google.golang.org/grpc/reflection"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/examples/payments"
	"github.com/exactlyonce/idempotency/examples/payments/outbox"
	"github.com/exactlyonce/idempotency/examples/payments/provider"
	"github.com/exactlyonce/idempotency/idempotencyotel"
	"github.com/exactlyonce/idempotency/internal/dburl"
)

func main() {
	cfg, err := parseFlags(flag.CommandLine, os.Args[1:])
	if err != nil {
		os.Exit(2) // the flag package has printed why
	}
	logger := slog.New(slog.NewTextHandler(os.Stderr, nil))
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	lis, err := openListeners(cfg)
	if err != nil {
		logger.Error("listen", "err", err)
		os.Exit(1)
	}
	if err := run(ctx, lis, cfg, logger); err != nil {
		logger.Error("server stopped", "err", err)
		os.Exit(1)
	}
}

type config struct {
	addr, httpAddr, connectAddr, metricsAddr string
	databaseURL                              string
	providerURL, providerAddr                string
	outbox                                   bool
	maxCharges                               int
	callers                                  payments.Callers // nil: the demo callers
}

// httpCallers are the callers of the HTTP API: -http-callers, or the demo
// ones.
func (c config) httpCallers() payments.Callers {
	if c.callers == nil {
		return payments.DemoCallers()
	}
	return c.callers
}

// poolReserve is the connections of the server's pool beyond -max-charges:
// for GetBalance, the key cleaner, the migrations and, with -outbox,
// River's listener and worker, which then find one while charges hold theirs.
const poolReserve = 4

// parseFlags reads the command line. The database URL's default comes
// from $DATABASE_URL, and -h shows it with the password masked.
func parseFlags(fs *flag.FlagSet, args []string) (config, error) {
	var c config
	fs.StringVar(&c.addr, "addr", "127.0.0.1:50051", "address to serve gRPC on")
	fs.StringVar(&c.httpAddr, "http-addr", "127.0.0.1:8080", "address to serve the same service as JSON over HTTP on (POST /v1/charges, GET /v1/accounts/{account_id}/balance); empty disables it")
	fs.StringVar(&c.connectAddr, "connect-addr", "127.0.0.1:8081", "address to serve the same service with connect-go on (the Connect protocol, gRPC and gRPC-Web: POST /payments.v1.PaymentService/Charge with a JSON body and the -http-callers' tokens); empty disables it")
	fs.StringVar(&c.metricsAddr, "metrics-addr", "127.0.0.1:9464", "address to serve Prometheus metrics on, at GET /metrics; empty disables it")
	fs.StringVar(&c.databaseURL, "database-url", "", dburl.Usage())
	fs.StringVar(&c.providerURL, "provider-url", "", "base URL of the payment provider to charge; empty serves the example provider in this process on -provider-addr")
	fs.StringVar(&c.providerAddr, "provider-addr", "127.0.0.1:0", "address to serve the example provider on when -provider-url is empty (the default, a free port, is logged); both empty keep charges in the ledger only")
	var callers string
	fs.StringVar(&callers, "http-callers", "", "the HTTP API's callers, as token=caller pairs separated by commas (each request sends Authorization: Bearer <token>; "+
		"the caller is its idempotency scope); empty accepts the demo callers alice (demo-token-alice) and bob (demo-token-bob)")
	fs.BoolVar(&c.outbox, "outbox", false, "charge the provider from a River worker after each call commits, instead of inside the call")
	fs.IntVar(&c.maxCharges, "max-charges", 32, fmt.Sprintf("charges to run at once, each on a database connection of its own (held while it waits for the provider); the pool has this many plus %d, and further charges wait for one, holding none", poolReserve))
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	if c.addr == "" {
		fmt.Fprintln(fs.Output(), "-addr must not be empty")
		return c, errors.New("empty -addr")
	}
	if c.maxCharges < 1 {
		fmt.Fprintln(fs.Output(), "-max-charges must be at least 1")
		return c, errors.New("-max-charges < 1")
	}
	if callers != "" {
		var err error
		if c.callers, err = payments.ParseCallers(callers); err != nil {
			fmt.Fprintf(fs.Output(), "-http-callers: %v\n", err)
			return c, err
		}
	}
	if c.databaseURL == "" {
		c.databaseURL = dburl.URL()
	}
	if c.providerURL != "" {
		c.providerAddr = ""
	}
	return c, nil
}

// listeners are where the server serves; all but grpc may be nil.
type listeners struct {
	grpc, http, connect, metrics, provider net.Listener
}

// openListeners listens on the addresses of cfg; an empty one is left nil.
func openListeners(cfg config) (listeners, error) {
	var lis listeners
	for _, l := range []struct {
		addr string
		dst  *net.Listener
	}{{cfg.addr, &lis.grpc}, {cfg.httpAddr, &lis.http}, {cfg.connectAddr, &lis.connect}, {cfg.metricsAddr, &lis.metrics}, {cfg.providerAddr, &lis.provider}} {
		if l.addr == "" {
			continue
		}
		var err error
		if *l.dst, err = net.Listen("tcp", l.addr); err != nil {
			lis.close()
			return listeners{}, err
		}
	}
	return lis, nil
}

// close closes the listeners that are open, for a start that failed.
func (lis listeners) close() {
	for _, l := range []net.Listener{lis.grpc, lis.http, lis.connect, lis.metrics, lis.provider} {
		if l != nil {
			_ = l.Close()
		}
	}
}

// run serves until ctx is done, then stops gracefully.
func run(ctx context.Context, lis listeners, cfg config, logger *slog.Logger) error {
	defer lis.close()
	tracer := idempotency.LogTracer(logger)
	var metricsHandler http.Handler
	if lis.metrics != nil {
		// The store's OpenTelemetry metrics, read by Prometheus's exporter
		// on every scrape of its own registry.
		registry := prometheus.NewRegistry()
		exporter, err := otelprometheus.New(otelprometheus.WithRegisterer(registry))
		if err != nil {
			return fmt.Errorf("metrics: %w", err)
		}
		meters := sdkmetric.NewMeterProvider(sdkmetric.WithReader(exporter))
		defer func() { _ = meters.Shutdown(context.Background()) }()
		otelTracer, err := idempotencyotel.NewTracer(idempotencyotel.WithMeterProvider(meters))
		if err != nil {
			return fmt.Errorf("metrics: %w", err)
		}
		tracer = idempotency.JoinTracers(tracer, otelTracer)
		metricsHandler = promhttp.HandlerFor(registry, promhttp.HandlerOpts{})
	}

	pool, err := openPool(ctx, cfg.databaseURL, int32(cfg.maxCharges+poolReserve))
	if err != nil {
		return err
	}
	defer pool.Close()
	store, err := idempotency.NewStore(pool, idempotency.WithTracer(tracer))
	if err != nil {
		return err
	}
	if err := payments.Migrate(ctx, pool, store); err != nil {
		return fmt.Errorf("migrate (is PostgreSQL reachable at -database-url?): %w", err)
	}
	cleaned := make(chan struct{})
	go func() {
		defer close(cleaned)
		_ = store.RunCleaner(ctx, time.Minute, 1000, func(err error) { logger.Warn("cleaner", "err", err) })
	}()
	defer func() { <-cleaned }()

	svc, providerHandler, stopCharges, err := chargePath(ctx, pool, store, cfg, lis, logger)
	defer stopCharges()
	if err != nil {
		return err
	}
	srv := payments.NewGRPCServer(svc, store)
	reflection.Register(srv)
	served := make(chan error, 4)
	go func() { served <- srv.Serve(lis.grpc) }()
	logger.Info("PaymentService listening", "grpc", lis.grpc.Addr().String())
	connectHandler, err := payments.NewConnectHandler(svc, store, cfg.httpCallers())
	if err != nil {
		return err
	}
	var httpServers []*http.Server
	for _, s := range []struct {
		lis     net.Listener
		handler http.Handler
		what    string
		msg     string
	}{
		{lis.http, payments.NewHTTPHandler(svc, store, cfg.httpCallers()), "http", "PaymentService listening"},
		{lis.connect, connectHandler, "connect", "PaymentService listening"},
		{lis.metrics, metricsMux(metricsHandler), "metrics", "PaymentService listening"},
		{lis.provider, providerHandler, "http", "example payment provider listening"},
	} {
		if s.lis == nil {
			continue
		}
		hs := &http.Server{Handler: s.handler, ReadHeaderTimeout: 10 * time.Second, Protocols: new(http.Protocols)}
		// HTTP/2 without TLS too: gRPC, through connect, needs it.
		hs.Protocols.SetHTTP1(true)
		hs.Protocols.SetUnencryptedHTTP2(true)
		httpServers = append(httpServers, hs)
		go func() { served <- hs.Serve(s.lis) }()
		logger.Info(s.msg, s.what, s.lis.Addr().String())
	}

	select {
	case err := <-served:
		srv.Stop()
		for _, hs := range httpServers {
			_ = hs.Close()
		}
		return err
	case <-ctx.Done():
	}
	logger.Info("shutting down: finishing calls in flight")
	sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	done := make(chan struct{})
	go func() { srv.GracefulStop(); close(done) }()
	for _, hs := range httpServers {
		_ = hs.Shutdown(sctx)
	}
	select {
	case <-done:
	case <-sctx.Done():
		srv.Stop()
	}
	for range 1 + len(httpServers) {
		if err := <-served; err != nil && !errors.Is(err, grpc.ErrServerStopped) && !errors.Is(err, http.ErrServerClosed) {
			return err
		}
	}
	return nil
}

// openPool connects to the database with a pool of maxConns connections.
// A pool_max_conns in the URL is refused rather than overridden: the pool
// is sized from -max-charges.
func openPool(ctx context.Context, databaseURL string, maxConns int32) (*pgxpool.Pool, error) {
	pcfg, err := pgxpool.ParseConfig(databaseURL)
	if err != nil {
		return nil, fmt.Errorf("-database-url: %w", err)
	}
	if strings.Contains(databaseURL, "pool_max_conns") {
		return nil, errors.New("-database-url sets pool_max_conns: size the pool with -max-charges instead")
	}
	pcfg.MaxConns = maxConns
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return nil, fmt.Errorf("database: %w", err)
	}
	return pool, nil
}

// chargePath builds the PaymentService with its way to the provider: the
// provider's own handler when this process serves it, and the outbox's
// worker when -outbox; stop stops the worker and closes the provider's
// pool.
func chargePath(ctx context.Context, pool *pgxpool.Pool, store *idempotency.Store, cfg config, lis listeners, logger *slog.Logger) (svc *payments.Server, providerHandler http.Handler, stop func(), err error) {
	stop = func() {}
	url := cfg.providerURL
	if lis.provider != nil {
		// The provider stands for another service, with connections of its
		// own: on the service's pool, charges holding every connection
		// while they wait for the provider would leave it none to answer
		// them with. Its handler waits for nothing while it holds one, so
		// pgx's default size serves any number of charges, a few at a time.
		ppool, err := pgxpool.New(ctx, cfg.databaseURL)
		if err != nil {
			return nil, nil, stop, fmt.Errorf("provider database: %w", err)
		}
		pstore, err := provider.NewStore(ppool, idempotency.WithTracer(idempotency.LogTracer(logger.With("service", "provider"))))
		if err == nil {
			err = provider.Migrate(ctx, ppool, pstore)
		}
		if err != nil {
			ppool.Close()
			return nil, nil, stop, fmt.Errorf("provider: %w", err)
		}
		providerHandler = provider.NewHandler(pstore)
		url = "http://" + lis.provider.Addr().String()
		stop = ppool.Close
	}
	if url == "" {
		return payments.NewServer(pool), nil, stop, nil
	}
	client := &provider.Client{BaseURL: url, Merchant: "payments-example"}
	if !cfg.outbox {
		return payments.NewServer(pool, payments.WithProvider(client)), providerHandler, stop, nil
	}
	if err := outbox.Migrate(ctx, pool); err != nil {
		return nil, nil, stop, fmt.Errorf("outbox: %w", err)
	}
	ob, err := outbox.New(pool, outbox.Config{Provider: client, Store: store, Logger: logger.With("service", "outbox")})
	if err == nil {
		err = ob.Start(context.WithoutCancel(ctx))
	}
	if err != nil {
		return nil, nil, stop, err
	}
	closeProvider := stop
	stop = func() {
		sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := ob.Stop(sctx); err != nil {
			logger.Warn("outbox worker stopped", "err", err)
		}
		closeProvider()
	}
	return payments.NewServer(pool, payments.WithOutbox(ob)), providerHandler, stop, nil
}

// metricsMux serves h at GET /metrics.
func metricsMux(h http.Handler) http.Handler {
	if h == nil {
		return nil
	}
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", h)
	return mux
}
