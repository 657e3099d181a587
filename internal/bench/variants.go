package main

import (
	"context"
	"fmt"
	"net/http"
	"runtime/pprof"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/retry"
	"github.com/jackc/pgx/v5"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	"github.com/exactlyonce/idempotency"
	testingv1 "github.com/exactlyonce/idempotency/internal/testpb/idempotency/testing/v1"
)

// keyUse is how a variant's calls pick their idempotency key.
type keyUse int

const (
	noKey     keyUse = iota
	freshKey         // a new key per call
	replayKey        // the client's one finished key, every call
	sharedKey        // the group's current key; the group walks through keys together
)

// variant is one kind of call, measured once per round.
type variant struct {
	Name    string       `json:"name"`
	About   string       `json:"about"`
	Slots   []slotResult `json:"rounds"`
	Probe   []probeShape `json:"probe,omitempty"`
	server  *server      // nil for the engine-only and HTTP variants
	url     string       // the HTTP variants' route
	method  string
	handler *handler // nil for the no-database method
	keys    keyUse
	retry   bool // mark each call as a retry attempt (x-retry-attempt: 1)
	// resend sends each call as a proxy resends a first attempt of a
	// client of the previous release: idempotency-key-new, no retry marker.
	resend   bool
	cleaner  bool // run the expiry cleaner during the variant's runs
	probe    bool // list the round trips of single calls
	outcomes *outcomeCounts
	// direct, when set, runs the call in this process without gRPC.
	direct func(ctx context.Context, key string, req *testingv1.Request) error
}

// variants returns the variants of the chosen scenarios, each once, in the
// order a round runs them.
func (b *bench) variants() []*variant {
	byScenario := map[string][]*variant{}
	// The fresh and engine scenarios run every chosen handler; the others
	// use the trivial one, whose variants have the bare names.
	var grpcOrder, engineOrder []*variant
	var fresh, plain *variant
	for _, h := range b.allHandlers {
		grpcVs := []*variant{
			{Name: "fresh" + h.name, server: b.idem, handler: h, keys: freshKey, probe: true,
				About: "interceptor, a new key per call; the handler writes in the call's transaction"},
			{Name: "floor" + h.name, server: b.floor, handler: h, keys: freshKey, probe: true,
				About: "no interceptor; BEGIN, the handler's write, then [INSERT of the engine's key row; COMMIT] in one round trip"},
			{Name: "plain" + h.name, server: b.plain, handler: h, probe: true,
				About: "no interceptor; the handler writes in its own BEGIN/write/COMMIT"},
		}
		engineVs := []*variant{
			{Name: "engine:execute" + h.name, handler: h, keys: freshKey, probe: true, outcomes: new(outcomeCounts),
				About: "no gRPC: Store.Execute with a new key per call runs the handler"},
			{Name: "engine:floor" + h.name, handler: h, keys: freshKey, probe: true,
				About: "no gRPC: the floor (the handler plus the key row sent with the COMMIT)"},
			{Name: "engine:plain" + h.name, handler: h, probe: true,
				About: "no gRPC: the handler in pgx.BeginFunc"},
		}
		b.direct(engineVs[0], engineVs[1], engineVs[2])
		var httpVs []*variant
		if h.name == "" {
			fresh, plain = grpcVs[0], grpcVs[2]
			// They run right after gRPC's trivial variants, so fresh and
			// plain over both transports are measured side by side.
			httpFresh := &variant{Name: "http-fresh", url: "http://" + b.web.addr + routeIdempotent, handler: h, keys: freshKey,
				probe: true, outcomes: b.web.outcomes,
				About: "HTTP middleware, a new key per call; the handler writes in the request's transaction, answers JSON"}
			httpPlain := &variant{Name: "http-plain", url: "http://" + b.web.addr + routePlain, handler: h, probe: true,
				About: "HTTP without the middleware; the same handler in its own BEGIN/write/COMMIT"}
			byScenario["http"] = []*variant{httpFresh, httpPlain, fresh, plain}
			httpVs = []*variant{httpFresh, httpPlain}
		} else {
			for _, v := range append(grpcVs, engineVs...) {
				v.About += " (payments handler)"
			}
		}
		if slices.Contains(b.handlers, h) {
			byScenario["fresh"] = append(byScenario["fresh"], grpcVs...)
			byScenario["engine"] = append(byScenario["engine"], engineVs...)
		}
		grpcOrder = append(append(grpcOrder, grpcVs...), httpVs...)
		engineOrder = append(engineOrder, engineVs...)
	}
	replay := &variant{Name: "replay", server: b.idem, handler: fresh.handler, keys: replayKey, retry: true, probe: true,
		About: "interceptor, every call repeats the client's finished key, marked as a retry (x-retry-attempt: 1)"}
	unmarked := &variant{Name: "unmarked-replay", server: b.idem, handler: fresh.handler, keys: replayKey, probe: true,
		About: "the same without the retry marker: the claim finds the result, in a transaction that rolls back"}
	resend := &variant{Name: "proxy-resend", server: b.idem, handler: fresh.handler, keys: replayKey, resend: true, probe: true,
		About: "a finished key resent as first sent, idempotency-key-new: true and no retry marker (a mesh's retry): must replay, never run"}
	noDB := &variant{Name: "no-db", server: b.plain, method: methodEcho, probe: true,
		About: "no interceptor; a handler that touches no database"}
	contended := &variant{Name: "contended", server: b.idem, handler: fresh.handler, keys: sharedKey,
		About: fmt.Sprintf("interceptor; %d groups of clients send the same new key at once", min(b.cfg.ContendedKeys, b.cfg.Clients))}
	noKeyV := &variant{Name: "no-key", server: b.idem, method: methodEcho, probe: true,
		About: "interceptor, no key: the call passes through to the no-database handler"}
	byScenario["replay"] = []*variant{replay, unmarked, resend, plain, noDB, fresh}
	byScenario["contended"] = []*variant{contended, plain, fresh}
	byScenario["nokey"] = []*variant{noKeyV, noDB}
	// A round runs the variants in this order, so that each variant is
	// measured right next to its main baselines.
	order := append(append(grpcOrder, engineOrder...), replay, unmarked, resend, noDB, noKeyV, contended)
	if b.preloaded != nil {
		n := humanCount(b.cfg.Preload)
		pre := &variant{Name: "fresh-" + n, server: b.preloaded, handler: fresh.handler, keys: freshKey, probe: true,
			About: fmt.Sprintf("fresh, on a key table holding %s keys (%.0f%% expired)", n, 100*b.cfg.PreloadExpired)}
		byScenario["preload"] = []*variant{pre, fresh}
		order = append(order, pre)
		if b.cleanerStore != nil {
			withCleaner := &variant{Name: pre.Name + "+cleaner", server: b.preloaded, handler: fresh.handler, keys: freshKey, cleaner: true,
				About: fmt.Sprintf("%s while RunCleaner deletes expired keys (every %v, batches of %d)", pre.Name, b.cfg.CleanerInterval, b.cfg.CleanerBatch)}
			byScenario["preload"] = append(byScenario["preload"], withCleaner)
			order = append(order, withCleaner)
		}
	}
	chosen := map[*variant]bool{}
	for _, s := range b.cfg.Scenarios {
		for _, v := range byScenario[s] {
			chosen[v] = true
		}
	}
	var vs []*variant
	for _, v := range order {
		if chosen[v] {
			if v.handler != nil {
				v.method = v.handler.method
			}
			if v.server != nil {
				v.outcomes = v.server.outcomes
			}
			vs = append(vs, v)
		}
	}
	return vs
}

// direct makes the engine-only variants run their calls in this process,
// on the server's pool, without gRPC.
func (b *bench) direct(execute, floor, plain *variant) {
	h := execute.handler
	execute.direct = func(ctx context.Context, key string, req *testingv1.Request) error {
		// What the interceptor does before Execute: fingerprint the request.
		fp, err := idempotency.Fingerprint(h.method, req)
		if err != nil {
			return err
		}
		res, err := b.store.Execute(ctx, idempotency.Call{Key: key, Method: h.method, Fingerprint: fp, TTL: idempotency.DefaultTTL},
			func(ctx context.Context, tx pgx.Tx) (proto.Message, error) { return h.write(ctx, tx, req) })
		execute.outcomes.add(res.Outcome)
		return err
	}
	floor.direct = func(ctx context.Context, key string, req *testingv1.Request) error {
		_, err := b.floorTable.run(ctx, b.pool, h, key, req)
		return err
	}
	plain.direct = func(ctx context.Context, _ string, req *testingv1.Request) error {
		_, err := runPlain(ctx, b.pool, h, req)
		return err
	}
}

func humanCount(n int) string {
	switch {
	case n >= 1_000_000 && n%100_000 == 0:
		return strings.TrimSuffix(fmt.Sprintf("%.1f", float64(n)/1e6), ".0") + "M"
	case n >= 1000 && n%100 == 0:
		return strings.TrimSuffix(fmt.Sprintf("%.1f", float64(n)/1e3), ".0") + "k"
	}
	return fmt.Sprint(n)
}

// client is one caller with its own connection to each server.
type client struct {
	id     int
	conns  map[*server]*grpc.ClientConn
	http   *http.Client       // keeps one connection alive to the HTTP server
	req    *testingv1.Request // the trivial handler's, the same for every call
	charge *testingv1.Request // the payments handler's, its account changed per call
	resp   *testingv1.Response

	replay string // the finished key this client replays
	prefix string // the shared keys of the current run
	seq    int
	lat    []time.Duration
}

func (c *client) key(v *variant, kind string) string {
	switch v.keys {
	case freshKey:
		if kind == "v4" {
			return uuid.NewString()
		}
		return uuid.Must(uuid.NewV7()).String()
	case replayKey:
		return c.replay
	case sharedKey:
		c.seq++
		return c.prefix + "-" + fmt.Sprint(c.seq)
	}
	return ""
}

func (c *client) call(ctx context.Context, v *variant, kind string) error {
	req := c.req
	if v.handler != nil {
		req = v.handler.request(c)
	}
	key := c.key(v, kind)
	if v.direct != nil {
		return v.direct(ctx, key, req)
	}
	if v.url != "" {
		return c.postHTTP(ctx, v.url, key, req)
	}
	if key != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, idempotency.MetadataKey, key)
	}
	if v.retry {
		// As go-grpc-middleware's retry interceptor marks a second attempt.
		ctx = metadata.AppendToOutgoingContext(ctx, retry.AttemptMetadataKey, "1")
	}
	if v.resend {
		// What the client interceptor of the previous release sent with the
		// keys it generated, and a proxy sends again on its retry.
		ctx = metadata.AppendToOutgoingContext(ctx, "idempotency-key-new", "true")
	}
	return c.conns[v.server].Invoke(ctx, v.method, req, c.resp)
}

// prepare gives each client of a replay variant a finished key.
func (b *bench) prepare(ctx context.Context, v *variant) error {
	if v.keys != replayKey {
		return nil
	}
	for _, c := range b.clients {
		c.replay = "replay-" + b.schema + "-" + fmt.Sprint(c.id)
		key := metadata.AppendToOutgoingContext(ctx, idempotency.MetadataKey, c.replay)
		if err := c.conns[v.server].Invoke(key, v.method, c.req, c.resp); err != nil {
			return fmt.Errorf("%s: first call of key %s: %w", v.Name, c.replay, err)
		}
	}
	return nil
}

// slotResult is one measured run of one variant.
type slotResult struct {
	Round      int           `json:"round"`
	Calls      int64         `json:"calls"`
	Errors     int64         `json:"errors"`
	FirstError string        `json:"first_error,omitempty"`
	Elapsed    time.Duration `json:"elapsed_ns"`
	P50        time.Duration `json:"p50_ns"`
	P99        time.Duration `json:"p99_ns"`
	DB         dbWork        `json:"db"`
	Problems   []string      `json:"problems,omitempty"`
}

func (s slotResult) rate() float64 { return float64(s.Calls) / s.Elapsed.Seconds() }

// brief is the progress line's summary of the database work.
func (s slotResult) brief() string {
	if s.Calls == 0 {
		return ""
	}
	n := float64(s.Calls)
	line := fmt.Sprintf("round trips/call %.2f", float64(s.DB.Wire.RoundTrips)/n)
	if s.DB.WAL != nil {
		line += fmt.Sprintf("  durable commits/call %.2f", float64(s.DB.WAL["Transaction/COMMIT"].Count)/n)
	}
	return line
}

// dbWork is what the database did during one measured run, all calls
// together.
type dbWork struct {
	Wire  wireCounts
	Trace traceCounts
	PG    struct {
		Commits, Rollbacks, WALBytes, WALRecords, WALFPI, WALSyncs, Xids int64
		// OtherXacts and OtherSessions show work that was not the tool's:
		// transactions in other databases, sessions in this one.
		OtherXacts, OtherSessions int64
		Tables                    map[string]tableCounters
	}
	// CPU is the CPU time used by this process (clients and servers) and
	// by the pools' PostgreSQL backends, when they run on this machine
	// (PGKnown).
	CPU struct {
		Go, PG  time.Duration
		PGKnown bool
	}
	// WAL is the WAL written, by record type (pg_walinspect); cluster-wide.
	WAL      map[string]walRecord
	Outcomes [16]int64 // by idempotency.Outcome
}

// runSlot runs v on every client for d. Measured runs are bracketed by
// readings of every counter; nothing else touches the database meanwhile,
// so the differences are the calls' own work.
func (b *bench) runSlot(ctx context.Context, v *variant, d time.Duration, measure bool) (slotResult, error) {
	var res slotResult
	var pg0 pgCounters
	var tr0 traceCounts
	var w0 wireCounts
	var out0 [16]int64
	var cpu0 time.Duration
	if measure {
		var err error
		if pg0, _, err = b.stats.read(ctx); err != nil {
			return res, err
		}
		tr0, w0, out0, cpu0 = b.tracer.read(), b.wire.read(), v.outcomes.read(), ownCPU()
	}

	var cleanerErrs []string
	var cleanerMu sync.Mutex
	stopCleaner := func() {}
	if v.cleaner {
		cctx, cancel := context.WithCancel(ctx)
		done := make(chan struct{})
		go func() {
			defer close(done)
			_ = b.cleanerStore.RunCleaner(cctx, b.cfg.CleanerInterval, b.cfg.CleanerBatch, func(err error) {
				cleanerMu.Lock()
				cleanerErrs = append(cleanerErrs, err.Error())
				cleanerMu.Unlock()
			})
		}()
		stopCleaner = func() { cancel(); <-done }
	}

	prefix := fmt.Sprintf("shared-%s-%d", b.schema, time.Now().UnixNano())
	errs := make([]error, len(b.clients))
	counts := make([]int64, len(b.clients))
	var wg sync.WaitGroup
	start := time.Now()
	stop := start.Add(d)
	for i, c := range b.clients {
		c.lat = c.lat[:0]
		c.prefix = fmt.Sprintf("%s-%d", prefix, i%min(b.cfg.ContendedKeys, len(b.clients)))
		c.seq = 0
		wg.Add(1)
		go func() {
			defer wg.Done()
			// The label lets -cpuprofile be read per variant (pprof
			// -tagfocus variant=NAME): the whole call for the engine-only
			// variants, the client's side for the others.
			pprof.Do(ctx, pprof.Labels("variant", v.Name), func(ctx context.Context) {
				for time.Now().Before(stop) && ctx.Err() == nil {
					t := time.Now()
					err := c.call(ctx, v, b.cfg.KeyKind)
					c.lat = append(c.lat, time.Since(t))
					if err != nil {
						counts[i]++
						if errs[i] == nil {
							errs[i] = err
						}
					}
				}
			})
		}()
	}
	wg.Wait()
	res.Elapsed = time.Since(start)
	stopCleaner()
	if err := ctx.Err(); err != nil {
		return res, err
	}

	var lat []time.Duration
	for i, c := range b.clients {
		lat = append(lat, c.lat...)
		res.Errors += counts[i]
		if errs[i] != nil && res.FirstError == "" {
			res.FirstError = errs[i].Error()
		}
	}
	res.Calls = int64(len(lat))
	slices.Sort(lat)
	if len(lat) > 0 {
		res.P50 = lat[len(lat)/2]
		res.P99 = lat[(len(lat)*99+99)/100-1]
	}
	if !measure {
		if res.Errors > 0 {
			return res, fmt.Errorf("%s: %d of %d calls failed during warm-up, the first with: %s", v.Name, res.Errors, res.Calls, res.FirstError)
		}
		return res, nil
	}

	tr1, w1, out1, cpu1 := b.tracer.read(), b.wire.read(), v.outcomes.read(), ownCPU()
	pg1, flushed, err := b.stats.read(ctx)
	if err != nil {
		return res, err
	}
	db := &res.DB
	db.Wire, db.Trace = w1.sub(w0), tr1.sub(tr0)
	db.PG.Commits = pg1.commits - pg0.commits - selfXacts(flushed)
	db.PG.Rollbacks = pg1.rollbacks - pg0.rollbacks
	db.PG.WALBytes, db.PG.WALRecords, db.PG.WALFPI = pg1.walBytes-pg0.walBytes, pg1.walRecords-pg0.walRecords, pg1.walFPI-pg0.walFPI
	db.PG.WALSyncs, db.PG.Xids = pg1.walSyncs-pg0.walSyncs, pg1.nextXid-pg0.nextXid
	db.PG.OtherXacts = pg1.otherXacts - pg0.otherXacts
	db.PG.OtherSessions = max(pg0.otherSessions, pg1.otherSessions)
	db.PG.Tables = map[string]tableCounters{}
	for name, t1 := range pg1.tables {
		t0 := pg0.tables[name]
		db.PG.Tables[name] = tableCounters{Dead: t1.Dead - t0.Dead, Ins: t1.Ins - t0.Ins, Upd: t1.Upd - t0.Upd,
			HotUpd: t1.HotUpd - t0.HotUpd, Del: t1.Del - t0.Del, Vacuums: t1.Vacuums - t0.Vacuums}
	}
	db.CPU.Go = cpu1 - cpu0
	db.CPU.PG, db.CPU.PGKnown = cpuBetween(pg0, pg1)
	db.WAL = b.stats.walRecords(ctx, pg0, pg1)
	for i := range out1 {
		db.Outcomes[i] = out1[i] - out0[i]
	}
	res.Problems = append(v.check(res), cleanerErrs...)
	return res, nil
}

// check reports calls that failed or did not do what the variant is for.
func (v *variant) check(s slotResult) []string {
	var p []string
	if s.Errors > 0 {
		p = append(p, fmt.Sprintf("%s: %d of %d calls failed, the first with: %s", v.Name, s.Errors, s.Calls, s.FirstError))
	}
	if v.outcomes == nil {
		return p
	}
	o := s.DB.Outcomes
	executed, replayed := o[idempotency.OutcomeExecuted], o[idempotency.OutcomeReplayed]
	var total int64
	for _, n := range o {
		total += n
	}
	ok := s.Calls - s.Errors
	var bad bool
	switch v.keys {
	case noKey:
		bad = total != 0
	case freshKey:
		bad = executed != ok || total != s.Calls
	case replayKey:
		bad = replayed != ok || total != s.Calls
	case sharedKey:
		bad = executed+replayed != ok || executed == 0
	}
	if bad {
		p = append(p, fmt.Sprintf("%s: unexpected outcomes for %d calls: %d executed, %d replayed, %d in all", v.Name, s.Calls, executed, replayed, total))
	}
	return p
}

// probeShape is one sequence of round trips seen for single calls.
type probeShape struct {
	Calls      int      `json:"calls"`
	RoundTrips int64    `json:"round_trips"` // counted on the wire
	Steps      []string `json:"steps"`       // as the tracer saw them
}

// probe runs n calls of v one at a time and groups them by the round trips
// they made.
func (b *bench) probe(ctx context.Context, v *variant, n int) ([]probeShape, error) {
	c := b.clients[0]
	c.prefix, c.seq = fmt.Sprintf("probe-%s-%d", b.schema, time.Now().UnixNano()), 0
	var shapes []probeShape
	for range n {
		w0 := b.wire.read()
		b.tracer.startProbe()
		err := c.call(ctx, v, b.cfg.KeyKind)
		steps := b.tracer.stopProbe()
		if err != nil {
			return nil, fmt.Errorf("probe %s: %w", v.Name, err)
		}
		rt := b.wire.read().sub(w0).RoundTrips
		i := slices.IndexFunc(shapes, func(s probeShape) bool { return s.RoundTrips == rt && slices.Equal(s.Steps, steps) })
		if i < 0 {
			shapes = append(shapes, probeShape{RoundTrips: rt, Steps: steps})
			i = len(shapes) - 1
		}
		shapes[i].Calls++
	}
	slices.SortStableFunc(shapes, func(a, b probeShape) int { return b.Calls - a.Calls })
	return shapes, nil
}
