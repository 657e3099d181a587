// Command server runs the example PaymentService with the idempotency
// interceptor on PostgreSQL, over gRPC and, on the same store and business
// code, as JSON over HTTP.
//
//	go run ./examples/payments/server -addr 127.0.0.1:50051 -http-addr 127.0.0.1:8080 -database-url "$DATABASE_URL"
//
// It migrates its tables on start, registers gRPC server reflection (so
// grpcurl can list and call it), logs one line per keyed call, and shuts
// down gracefully on SIGINT or SIGTERM.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"
	"google.golang.org/grpc/reflection"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/examples/payments"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

func main() {
	cfg, err := parseFlags(flag.CommandLine, os.Args[1:])
	if err != nil {
		os.Exit(2) // the flag package has printed why
	}
	logger := slog.New(slog.NewTextHandler(os.Stderr, nil))
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	lis, err := net.Listen("tcp", cfg.addr)
	if err != nil {
		logger.Error("listen", "addr", cfg.addr, "err", err)
		os.Exit(1)
	}
	var httpLis net.Listener
	if cfg.httpAddr != "" {
		if httpLis, err = net.Listen("tcp", cfg.httpAddr); err != nil {
			logger.Error("listen", "addr", cfg.httpAddr, "err", err)
			os.Exit(1)
		}
	}
	if err := run(ctx, lis, httpLis, cfg.databaseURL, logger); err != nil {
		logger.Error("server stopped", "err", err)
		os.Exit(1)
	}
}

type config struct {
	addr, httpAddr, databaseURL string
}

// parseFlags reads the command line. The database URL's default comes
// from $DATABASE_URL, and -h shows it with the password masked.
func parseFlags(fs *flag.FlagSet, args []string) (config, error) {
	var c config
	fs.StringVar(&c.addr, "addr", "127.0.0.1:50051", "address to serve gRPC on")
	fs.StringVar(&c.httpAddr, "http-addr", "127.0.0.1:8080", "address to serve the same service as JSON over HTTP on (POST /v1/charges, GET /v1/accounts/{account_id}/balance); empty disables it")
	fs.StringVar(&c.databaseURL, "database-url", "", "PostgreSQL URL (default: $DATABASE_URL, else the local test database: "+redactURL(testdb.URL())+")")
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	if c.databaseURL == "" {
		c.databaseURL = testdb.URL()
	}
	return c, nil
}

// redactURL masks the password of a database URL, for showing it.
func redactURL(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "(unparsable URL)"
	}
	return u.Redacted()
}

// run serves gRPC on lis and, when httpLis is not nil, HTTP on httpLis,
// until ctx is done, then stops both gracefully.
func run(ctx context.Context, lis, httpLis net.Listener, dbURL string, logger *slog.Logger) error {
	defer lis.Close()
	pool, err := pgxpool.New(ctx, dbURL)
	if err != nil {
		return fmt.Errorf("database: %w", err)
	}
	defer pool.Close()
	store, err := idempotency.NewStore(pool)
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

	srv := payments.NewGRPCServer(pool, store, logger)
	reflection.Register(srv)
	logger.Info("PaymentService listening", "grpc", lis.Addr().String())
	served := make(chan error, 2)
	servers := 1
	go func() { served <- srv.Serve(lis) }()

	var httpSrv *http.Server
	if httpLis != nil {
		httpSrv = &http.Server{Handler: payments.NewHTTPHandler(payments.NewServer(pool), store, logger), ReadHeaderTimeout: 10 * time.Second}
		logger.Info("PaymentService listening", "http", httpLis.Addr().String())
		servers++
		go func() { served <- httpSrv.Serve(httpLis) }()
	}
	select {
	case err := <-served:
		srv.Stop()
		if httpSrv != nil {
			_ = httpSrv.Close()
		}
		return err
	case <-ctx.Done():
	}
	logger.Info("shutting down: finishing calls in flight")
	sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	done := make(chan struct{})
	go func() { srv.GracefulStop(); close(done) }()
	if httpSrv != nil {
		_ = httpSrv.Shutdown(sctx)
	}
	select {
	case <-done:
	case <-sctx.Done():
		srv.Stop()
	}
	for range servers {
		if err := <-served; err != nil && !errors.Is(err, grpc.ErrServerStopped) && !errors.Is(err, http.ErrServerClosed) {
			return err
		}
	}
	return nil
}
