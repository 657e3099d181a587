package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/dburl"
	testingv1 "github.com/exactlyonce/idempotency/internal/testpb/idempotency/testing/v1"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	switch {
	case errors.Is(err, flag.ErrHelp):
		os.Exit(0)
	case errors.As(err, new(usageError)):
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(2)
	case err != nil:
		fmt.Fprintln(os.Stderr, "bench: FAIL:", err)
		os.Exit(1)
	}
}

type usageError struct{ error }

// config is the parsed command line.
type config struct {
	URL             string        `json:"-"`
	Duration        time.Duration `json:"duration"`
	Warmup          time.Duration `json:"warmup"`
	Rounds          int           `json:"rounds"`
	Clients         int           `json:"clients"`
	Pool            int           `json:"pool"`
	ResponseBytes   int           `json:"response_bytes"`
	Scenarios       []string      `json:"scenarios"`
	Handlers        []string      `json:"handlers"`
	Accounts        int           `json:"accounts"`
	ContendedKeys   int           `json:"contended_keys"`
	KeyKind         string        `json:"key_kind"`
	Preload         int           `json:"preload"`
	PreloadExpired  float64       `json:"preload_expired"`
	Cleaner         bool          `json:"cleaner"`
	CleanerInterval time.Duration `json:"cleaner_interval"`
	CleanerBatch    int           `json:"cleaner_batch"`
	Probe           int           `json:"probe"`
	Markdown        string        `json:"-"`
	JSON            string        `json:"-"`
	CPUProfile      string        `json:"-"`
	Keep            bool          `json:"-"`
	Short           bool          `json:"short"`
}

var allScenarios = []string{"fresh", "engine", "replay", "contended", "nokey", "http", "preload"}

func parseFlags(args []string, stderr io.Writer) (config, error) {
	var c config
	var scenarios, handlers string
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&c.URL, "url", "", dburl.Usage()+"; the tool works in a schema of its own there. On a shared server, give it a database of its own so its commit counts are its alone")
	fs.DurationVar(&c.Duration, "duration", 5*time.Second, "length of each measured run of a variant")
	fs.DurationVar(&c.Warmup, "warmup", time.Second, "unmeasured run of each variant before the first round")
	fs.IntVar(&c.Rounds, "rounds", 6, "rounds; each runs every variant once, in turn")
	fs.IntVar(&c.Clients, "clients", 8, "concurrent clients, each with its own gRPC and HTTP connections")
	fs.IntVar(&c.Pool, "pool", 0, "server pool size (0: clients+2)")
	fs.IntVar(&c.ResponseBytes, "response-bytes", 256, "size of the response body")
	fs.StringVar(&scenarios, "scenarios", "fresh,engine,replay,contended,nokey,http", "comma-separated: "+strings.Join(allScenarios, ", ")+" (preload is added when -preload > 0)")
	fs.StringVar(&handlers, "handlers", strings.Join(handlerNames, ","), "comma-separated handlers of the fresh and engine scenarios: "+strings.Join(handlerNames, ", ")+" (the other scenarios use trivial)")
	fs.IntVar(&c.Accounts, "accounts", 64, "accounts the payments handler spreads its charges over, at random")
	fs.IntVar(&c.ContendedKeys, "contended-keys", 2, "keys in flight at once in the contended scenario; clients share them evenly")
	fs.StringVar(&c.KeyKind, "keys", "v7", "fresh keys: v7 (time-ordered UUIDs, what the client interceptor sends) or v4 (random UUIDs)")
	fs.IntVar(&c.Preload, "preload", 0, "fill a second key table with this many finished keys and compare fresh calls on it with the small table")
	fs.Float64Var(&c.PreloadExpired, "preload-expired", 0.5, "fraction of the preloaded keys that are already expired")
	fs.BoolVar(&c.Cleaner, "cleaner", false, "with -preload: also run fresh calls while Store.RunCleaner deletes the expired keys")
	fs.DurationVar(&c.CleanerInterval, "cleaner-interval", time.Second, "RunCleaner interval")
	fs.IntVar(&c.CleanerBatch, "cleaner-batch", 1000, "RunCleaner batch size")
	fs.IntVar(&c.Probe, "probe", 20, "calls of each variant run one at a time to list the round trips of one call (0: none)")
	fs.StringVar(&c.Markdown, "markdown", "", "also write the report as markdown to this file")
	fs.StringVar(&c.JSON, "json", "", "also write every measurement as JSON to this file")
	fs.StringVar(&c.CPUProfile, "cpuprofile", "", "write a CPU profile of the measured rounds (server and clients) to this file; client goroutines carry the label variant=NAME")
	fs.BoolVar(&c.Keep, "keep", false, "keep the schema instead of dropping it at the end")
	fs.BoolVar(&c.Short, "short", false, "a few seconds in all, for CI: every scenario and handler with a small preload and the cleaner; numbers mean nothing")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return c, err
		}
		return c, usageError{err}
	}
	if c.URL == "" {
		c.URL = dburl.URL()
	}
	if fs.NArg() > 0 {
		return c, usageError{fmt.Errorf("unexpected arguments: %q", fs.Args())}
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if c.Short {
		short := map[string]func(){
			"duration":  func() { c.Duration = 150 * time.Millisecond },
			"warmup":    func() { c.Warmup = 50 * time.Millisecond },
			"rounds":    func() { c.Rounds = 2 },
			"clients":   func() { c.Clients = 4 },
			"scenarios": func() { scenarios = strings.Join(allScenarios, ",") },
			"preload":   func() { c.Preload = 5000 },
			"cleaner":   func() { c.Cleaner = true },
			"probe":     func() { c.Probe = 2 },
		}
		for name, apply := range short {
			if !set[name] {
				apply()
			}
		}
	}
	var err error
	if c.Scenarios, err = parseList("-scenarios", scenarios, allScenarios); err != nil {
		return c, err
	}
	if c.Handlers, err = parseList("-handlers", handlers, handlerNames); err != nil {
		return c, err
	}
	if c.Preload > 0 && !slices.Contains(c.Scenarios, "preload") {
		c.Scenarios = append(c.Scenarios, "preload")
	}
	if c.Pool == 0 {
		c.Pool = c.Clients + 2
	}
	switch {
	case len(c.Scenarios) == 0:
		return c, usageError{errors.New("-scenarios: none chosen")}
	case len(c.Handlers) == 0:
		return c, usageError{errors.New("-handlers: none chosen")}
	case c.Accounts < 1:
		return c, usageError{errors.New("-accounts must be positive")}
	case c.Duration <= 0 || c.Warmup < 0 || c.Rounds < 1 || c.Clients < 1 || c.Pool < 1:
		return c, usageError{errors.New("-duration, -rounds, -clients and -pool must be positive, -warmup not negative")}
	case c.ResponseBytes < 0:
		return c, usageError{errors.New("-response-bytes must not be negative")}
	case c.ContendedKeys < 1:
		return c, usageError{errors.New("-contended-keys must be positive")}
	case c.KeyKind != "v7" && c.KeyKind != "v4":
		return c, usageError{fmt.Errorf("-keys: want v7 or v4, got %q", c.KeyKind)}
	case slices.Contains(c.Scenarios, "preload") && c.Preload <= 0:
		return c, usageError{errors.New("the preload scenario needs -preload > 0")}
	case c.Cleaner && c.Preload <= 0:
		return c, usageError{errors.New("-cleaner needs -preload > 0: the cleaner deletes preloaded expired keys")}
	case c.PreloadExpired < 0 || c.PreloadExpired > 1:
		return c, usageError{errors.New("-preload-expired must be between 0 and 1")}
	case c.CleanerInterval <= 0 || c.CleanerBatch <= 0:
		return c, usageError{errors.New("-cleaner-interval and -cleaner-batch must be positive")}
	case c.Probe < 0:
		return c, usageError{errors.New("-probe must not be negative")}
	}
	return c, nil
}

// parseList parses a comma-separated flag whose values must be among known,
// dropping repeats.
func parseList(flagName, list string, known []string) ([]string, error) {
	var out []string
	for _, s := range strings.Split(list, ",") {
		s = strings.TrimSpace(s)
		switch {
		case s == "":
		case !slices.Contains(known, s):
			return nil, usageError{fmt.Errorf("%s: unknown value %q (want some of %s)", flagName, s, strings.Join(known, ", "))}
		case !slices.Contains(out, s):
			out = append(out, s)
		}
	}
	return out, nil
}

// commandLine is how the run was invoked, for the top of the report.
func commandLine(args []string) string {
	parts := []string{"go run ./internal/bench"}
	for _, a := range args {
		if strings.ContainsAny(a, " \t'\"$") {
			a = strconv.Quote(a)
		}
		parts = append(parts, a)
	}
	return strings.Join(parts, " ")
}

// run is the whole tool; main only maps its error to an exit status.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) (err error) {
	cfg, err := parseFlags(args, stderr)
	if err != nil {
		return err
	}
	logf := func(format string, a ...any) { fmt.Fprintf(stderr, "bench: "+format+"\n", a...) }

	b := &bench{cfg: cfg, logf: logf, wire: &wire{}}
	defer func() {
		if cerr := b.close(); err == nil {
			err = cerr
		}
	}()
	if err := b.setup(ctx); err != nil {
		return err
	}
	rep, err := b.measure(ctx)
	if err != nil {
		return err
	}
	rep.Command = commandLine(args)
	rep.Config = cfg
	rep.Environment = b.environment(ctx)
	rep.Preload = b.preloadInfo

	if err := rep.writeText(stdout); err != nil {
		return err
	}
	if cfg.Markdown != "" {
		if err := writeFile(cfg.Markdown, rep.writeMarkdown); err != nil {
			return err
		}
	}
	if cfg.JSON != "" {
		if err := writeFile(cfg.JSON, rep.writeJSON); err != nil {
			return err
		}
	}
	if len(rep.Failures) > 0 {
		return fmt.Errorf("%d problem(s):\n  %s", len(rep.Failures), strings.Join(rep.Failures, "\n  "))
	}
	return nil
}

func writeFile(name string, write func(io.Writer) error) error {
	f, err := os.Create(name)
	if err != nil {
		return err
	}
	if err := write(f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// bench holds everything a run set up, so close can take it down.
type bench struct {
	cfg  config
	logf func(string, ...any)

	schema      string
	admin       *pgx.Conn // setup, preload and the final drop
	pool        *pgxpool.Pool
	cleanerPool *pgxpool.Pool
	tracer      *tracer
	wire        *wire
	stats       *pgStats

	store, floorStore, preStore, cleanerStore *idempotency.Store
	idem, plain, floor, preloaded             *server
	web                                       *httpServer
	floorTable                                *floorTable
	allHandlers                               []*handler // trivial first
	handlers                                  []*handler // those chosen by -handlers
	clients                                   []*client
	preloadInfo                               *preloadInfo
}

func (b *bench) setup(ctx context.Context) error {
	var err error
	b.admin, err = connect(ctx, b.cfg.URL)
	if err != nil {
		return err
	}
	var rnd [4]byte
	_, _ = rand.Read(rnd[:])
	b.schema = "bench_" + hex.EncodeToString(rnd[:])
	if _, err := b.admin.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{b.schema}.Sanitize()); err != nil {
		return fmt.Errorf("create schema: %w", err)
	}
	b.logf("schema %s on %s", b.schema, dburl.Redacted(b.cfg.URL))

	b.tracer = newTracer(b.schema)
	b.pool, err = newPool(ctx, b.cfg.URL, b.schema, b.cfg.Pool, func(c *pgxpool.Config) {
		c.ConnConfig.Tracer = b.tracer
		c.ConnConfig.AfterNetConnect = b.wire.wrap
		c.MinConns = c.MaxConns // no connects inside measured runs
	})
	if err != nil {
		return err
	}
	// The store's calls are counted per transport: the gRPC interceptor's
	// and the HTTP middleware's; engine:execute counts its own results.
	grpcOutcomes, httpOutcomes := new(outcomeCounts), new(outcomeCounts)
	b.store, err = idempotency.NewStore(b.pool, idempotency.WithTable(b.schema, "idempotency_keys"),
		idempotency.WithTracer(outcomesByTransport(grpcOutcomes, httpOutcomes)))
	if err != nil {
		return err
	}
	if err := b.store.Migrate(ctx); err != nil {
		return err
	}
	// The floor's key table: the library's own migrations, so its columns
	// and indexes are the key table's.
	b.floorStore, err = idempotency.NewStore(b.pool, idempotency.WithTable(b.schema, floorTableName))
	if err != nil {
		return err
	}
	if err := b.floorStore.Migrate(ctx); err != nil {
		return err
	}
	b.floorTable = newFloorTable(b.schema)
	if _, err := b.pool.Exec(ctx, `CREATE TABLE ledger (id bigserial PRIMARY KEY, note text NOT NULL)`); err != nil {
		return fmt.Errorf("create ledger: %w", err)
	}
	if _, err := b.pool.Exec(ctx, paymentsTables); err != nil {
		return fmt.Errorf("create the payments tables: %w", err)
	}
	body := payload(b.cfg.ResponseBytes)
	svc := &service{pool: b.pool, payload: body, trivial: trivialHandler(body), payments: paymentsHandler(body, b.cfg.Accounts)}
	b.allHandlers = []*handler{svc.trivial, svc.payments}
	for i, name := range handlerNames {
		if slices.Contains(b.cfg.Handlers, name) {
			b.handlers = append(b.handlers, b.allHandlers[i])
		}
	}
	// Every account exists before the runs, so every charge is an update,
	// as in a service that has been running for a while.
	if _, err := b.pool.Exec(ctx, `INSERT INTO accounts (account_id) SELECT unnest($1::text[])`, svc.payments.accounts); err != nil {
		return fmt.Errorf("create accounts: %w", err)
	}

	if b.cfg.Preload > 0 {
		preOutcomes := new(outcomeCounts)
		b.preStore, err = idempotency.NewStore(b.pool, idempotency.WithTable(b.schema, preloadedTable),
			idempotency.WithTracer(outcomesByTransport(preOutcomes, nil)))
		if err != nil {
			return err
		}
		if err := b.preStore.Migrate(ctx); err != nil {
			return err
		}
		resp, err := marshalResponse(svc.payload)
		if err != nil {
			return err
		}
		if b.preloadInfo, err = preload(ctx, b.admin, pgx.Identifier{b.schema, preloadedTable}, b.cfg.Preload,
			b.cfg.PreloadExpired, methodWrite, resp, b.logf); err != nil {
			return err
		}
		if b.preloaded, err = startServer("preloaded", svc, b.preStore, preOutcomes); err != nil {
			return err
		}
	}
	if b.cfg.Cleaner {
		b.cleanerPool, err = newPool(ctx, b.cfg.URL, b.schema, 2, nil)
		if err != nil {
			return err
		}
		b.cleanerStore, err = idempotency.NewStore(finishingDB{b.cleanerPool}, idempotency.WithTable(b.schema, preloadedTable))
		if err != nil {
			return err
		}
	}
	if b.idem, err = startServer("interceptor", svc, b.store, grpcOutcomes); err != nil {
		return err
	}
	if b.plain, err = startServer("plain", svc, nil, nil); err != nil {
		return err
	}
	floorSvc := *svc
	floorSvc.floor = b.floorTable
	if b.floor, err = startServer("floor", &floorSvc, nil, nil); err != nil {
		return err
	}
	if b.web, err = startHTTPServer(b.pool, svc.trivial, b.store, httpOutcomes); err != nil {
		return err
	}

	statsConn, err := connect(ctx, b.cfg.URL)
	if err != nil {
		return err
	}
	b.stats = &pgStats{conn: statsConn, schema: b.schema, pools: []*pgxpool.Pool{b.pool}, logf: b.logf,
		walStats: findWalinspect(ctx, b.admin, b.schema, b.logf)}
	if b.cleanerPool != nil {
		b.stats.pools = append(b.stats.pools, b.cleanerPool)
	}
	// The setup's statistics must not reach the shared counters during a
	// measured run, as they would after the backend's idle timeout.
	if _, err := b.admin.Exec(ctx, flushStats); err != nil {
		return fmt.Errorf("flush statistics (needs PostgreSQL 15 or later): %w", err)
	}

	for i := range b.cfg.Clients {
		c := &client{
			id:     i,
			conns:  map[*server]*grpc.ClientConn{},
			http:   newHTTPClient(),
			req:    &testingv1.Request{Body: "the same request from every client", Amount: 100}, // duplicates must match
			charge: &testingv1.Request{Amount: 100},
			resp:   &testingv1.Response{},
		}
		for _, s := range []*server{b.idem, b.plain, b.floor, b.preloaded} {
			if s == nil {
				continue
			}
			conn, err := grpc.NewClient("passthrough:///"+s.addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
			if err != nil {
				return err
			}
			c.conns[s] = conn
		}
		b.clients = append(b.clients, c)
	}
	return nil
}

// finishingDB lets the cleaner's statement in flight finish when its run
// ends: cancelling it would close the connection, and the backend would
// report its last deletes during the next variant's run. A cancelled
// context still stops the cleaner at its next statement.
type finishingDB struct{ *pgxpool.Pool }

func (db finishingDB) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if err := ctx.Err(); err != nil {
		return pgconn.CommandTag{}, err
	}
	return db.Pool.Exec(context.WithoutCancel(ctx), sql, args...)
}

// measure runs the warm-up, the rounds and the probes.
func (b *bench) measure(ctx context.Context) (*report, error) {
	vs := b.variants()
	rep := &report{}
	for _, v := range vs {
		if err := b.prepare(ctx, v); err != nil {
			return nil, err
		}
	}
	if b.cfg.Warmup > 0 {
		for _, v := range vs {
			b.logf("warm-up: %s", v.Name)
			if _, err := b.runSlot(ctx, v, b.cfg.Warmup, false); err != nil {
				return nil, err
			}
		}
	}
	stopProfile, err := startCPUProfile(b.cfg.CPUProfile)
	if err != nil {
		return nil, err
	}
	defer stopProfile()
	for round := 1; round <= b.cfg.Rounds; round++ {
		for _, v := range vs {
			s, err := b.runSlot(ctx, v, b.cfg.Duration, true)
			if err != nil {
				return nil, err
			}
			s.Round = round
			v.Slots = append(v.Slots, s)
			b.logf("round %d/%d %-23s %8.0f calls/s  p50 %-8s p99 %-8s %s", round, b.cfg.Rounds, v.Name,
				s.rate(), fmtDur(s.P50), fmtDur(s.P99), s.brief())
		}
	}
	stopProfile()
	for _, v := range vs {
		if !v.probe || b.cfg.Probe == 0 {
			continue
		}
		p, err := b.probe(ctx, v, b.cfg.Probe)
		if err != nil {
			return nil, err
		}
		v.Probe = p
	}
	rep.analyse(vs, b.cfg)
	return rep, nil
}

// startCPUProfile profiles until the returned function is first called; an
// empty file name profiles nothing.
func startCPUProfile(file string) (stop func(), err error) {
	if file == "" {
		return func() {}, nil
	}
	f, err := os.Create(file)
	if err != nil {
		return nil, err
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, err
	}
	var once sync.Once
	return func() {
		once.Do(func() {
			pprof.StopCPUProfile()
			f.Close()
		})
	}, nil
}

func (b *bench) close() error {
	for _, c := range b.clients {
		for _, conn := range c.conns {
			conn.Close()
		}
		c.http.CloseIdleConnections()
	}
	for _, s := range []*server{b.idem, b.plain, b.floor, b.preloaded} {
		if s != nil {
			s.grpc.Stop()
		}
	}
	if b.web != nil {
		b.web.srv.Close()
	}
	if b.stats != nil {
		b.stats.conn.Close(context.Background())
	}
	for _, p := range []*pgxpool.Pool{b.pool, b.cleanerPool} {
		if p != nil {
			p.Close()
		}
	}
	if b.admin == nil {
		return nil
	}
	defer b.admin.Close(context.Background())
	if b.schema == "" {
		return nil
	}
	if b.cfg.Keep {
		b.logf("kept schema %s", b.schema)
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := b.admin.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{b.schema}.Sanitize()+" CASCADE"); err != nil {
		return fmt.Errorf("drop schema %s: %w", b.schema, err)
	}
	return nil
}

func connect(ctx context.Context, url string) (*pgx.Conn, error) {
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("-url: %w", err)
	}
	cfg.RuntimeParams["application_name"] = appName
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("connect to %s: %w", dburl.Redacted(url), err)
	}
	return conn, nil
}

// newPool returns a pool whose connections use the run's schema.
func newPool(ctx context.Context, url, schema string, size int, configure func(*pgxpool.Config)) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("-url: %w", err)
	}
	cfg.MaxConns = int32(size)
	cfg.MaxConnLifetime = 24 * time.Hour
	cfg.MaxConnIdleTime = 24 * time.Hour
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	cfg.ConnConfig.RuntimeParams["application_name"] = appName
	// pgxpool pings a connection idle for over a second before handing it
	// out; that would add a round trip after each pause between runs.
	cfg.ShouldPing = func(context.Context, pgxpool.ShouldPingParams) bool { return false }
	if configure != nil {
		configure(cfg)
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("connect to %s: %w", dburl.Redacted(url), err)
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("connect to %s: %w", dburl.Redacted(url), err)
	}
	return pool, nil
}
