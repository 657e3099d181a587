package main

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"runtime"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/exactlyonce/idempotency"
)

// report is everything a run measured, and what it makes of it.
type report struct {
	Command     string       `json:"command"`
	Environment []string     `json:"environment"`
	Config      config       `json:"config"`
	Preload     *preloadInfo `json:"preload,omitempty"`
	Variants    []*variant   `json:"variants"`
	Comparisons []comparison `json:"comparisons"`
	Targets     []target     `json:"targets"`
	Notes       []string     `json:"notes,omitempty"`
	Failures    []string     `json:"failures,omitempty"`
}

// summary is a variant's figures over all rounds: medians of the per-round
// rates and latencies, and per-call averages of the database work.
type summary struct {
	Rate, P50, P99 float64 // calls/s; latencies in seconds
	Calls          int64
	PerCall        map[string]float64
	WAL            map[string]walRecord // totals by record type; nil if not counted
	Tainted        bool                 // other work ran on the server during some round
}

// comparison is a variant against a baseline, round by round.
type comparison struct {
	Scenario   string  `json:"scenario"`
	A, B       string  `json:"-"`
	Label      string  `json:"label"`
	Rate       float64 `json:"throughput_ratio"`        // median A / median B
	RateRounds float64 `json:"throughput_ratio_rounds"` // median of the per-round ratios
	RateMin    float64 `json:"throughput_ratio_min"`    // of the per-round ratios
	RateMax    float64 `json:"throughput_ratio_max"`
	P50Ratio   float64 `json:"p50_ratio"`
	P99Ratio   float64 `json:"p99_ratio"`
}

// target is one of the goals with the figure measured for it.
type target struct {
	Goal     string `json:"goal"`
	Measured string `json:"measured"`
	Status   string `json:"status"` // met, MISSED, unsure (over the goal by no more than others' work could explain), or reported: no goal
}

func median(xs []float64) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func (v *variant) summary() summary {
	var rates, p50s, p99s []float64
	var sum dbWork
	sum.PG.Tables = map[string]tableCounters{}
	s := summary{PerCall: map[string]float64{}, WAL: map[string]walRecord{}}
	pgCPUUnknown := false
	for _, r := range v.Slots {
		if r.DB.WAL == nil {
			s.WAL = nil
		}
		for name, w := range r.DB.WAL {
			if s.WAL != nil {
				a := s.WAL[name]
				s.WAL[name] = walRecord{Count: a.Count + w.Count, Bytes: a.Bytes + w.Bytes}
			}
		}
		rates = append(rates, r.rate())
		p50s = append(p50s, r.P50.Seconds())
		p99s = append(p99s, r.P99.Seconds())
		s.Calls += r.Calls
		d := r.DB
		sum.Wire.RoundTrips += d.Wire.RoundTrips
		sum.Wire.BytesOut += d.Wire.BytesOut
		sum.Wire.BytesIn += d.Wire.BytesIn
		sum.Trace.RoundTrips += d.Trace.RoundTrips
		sum.Trace.Statements += d.Trace.Statements
		sum.Trace.Commits += d.Trace.Commits
		sum.Trace.Rollbacks += d.Trace.Rollbacks
		sum.Trace.Begins += d.Trace.Begins
		sum.Trace.Prepares += d.Trace.Prepares
		sum.Trace.Connects += d.Trace.Connects
		sum.PG.Commits += d.PG.Commits
		sum.PG.Rollbacks += d.PG.Rollbacks
		sum.PG.WALBytes += d.PG.WALBytes
		sum.PG.WALFPI += d.PG.WALFPI
		sum.PG.WALSyncs += d.PG.WALSyncs
		sum.PG.Xids += d.PG.Xids
		for i, n := range d.Outcomes {
			sum.Outcomes[i] += n
		}
		sum.CPU.Go += d.CPU.Go
		sum.CPU.PG += d.CPU.PG
		if !d.CPU.PGKnown {
			pgCPUUnknown = true
		}
		if d.PG.OtherXacts > 0 || d.PG.OtherSessions > 0 {
			s.Tainted = true
		}
		for name, t := range d.PG.Tables {
			a := sum.PG.Tables[name]
			a.Dead += t.Dead
			a.Ins += t.Ins
			a.Upd += t.Upd
			a.HotUpd += t.HotUpd
			a.Del += t.Del
			a.Vacuums += t.Vacuums
			sum.PG.Tables[name] = a
		}
	}
	s.Rate, s.P50, s.P99 = median(rates), median(p50s), median(p99s)
	n := float64(s.Calls)
	if n == 0 {
		n = math.NaN()
	}
	var keys, business tableCounters
	for name, t := range sum.PG.Tables {
		a := &business
		if name == "idempotency_keys" || name == preloadedTable || name == floorTableName {
			a = &keys
		}
		a.Dead += t.Dead
		a.Upd += t.Upd
		a.HotUpd += t.HotUpd
		a.Del += t.Del
		a.Vacuums += t.Vacuums
	}
	for k, x := range map[string]int64{
		"round_trips": sum.Wire.RoundTrips, "traced_round_trips": sum.Trace.RoundTrips,
		"statements": sum.Trace.Statements, "prepares": sum.Trace.Prepares, "connects": sum.Trace.Connects,
		"commits": sum.PG.Commits, "traced_commits": sum.Trace.Commits, "transactions": sum.PG.Commits + sum.PG.Rollbacks,
		"rollbacks": sum.PG.Rollbacks, "traced_rollbacks": sum.Trace.Rollbacks, "traced_begins": sum.Trace.Begins,
		"wal_bytes": sum.PG.WALBytes, "wal_fpi": sum.PG.WALFPI, "wal_fsyncs": sum.PG.WALSyncs, "xids": sum.PG.Xids,
		"bytes_to_pg": sum.Wire.BytesOut, "bytes_from_pg": sum.Wire.BytesIn,
		"dead_keys": keys.Dead, "dead_business": business.Dead,
		"key_updates": keys.Upd, "key_hot_updates": keys.HotUpd,
		"key_deletes": keys.Del, "vacuums": keys.Vacuums + business.Vacuums,
		"executed": sum.Outcomes[idempotency.OutcomeExecuted], "replayed": sum.Outcomes[idempotency.OutcomeReplayed],
	} {
		s.PerCall[k] = float64(x) / n
	}
	s.PerCall["go_cpu_us"] = sum.CPU.Go.Seconds() * 1e6 / n
	s.PerCall["pg_cpu_us"] = sum.CPU.PG.Seconds() * 1e6 / n
	if pgCPUUnknown {
		s.PerCall["pg_cpu_us"] = math.NaN()
	}
	s.PerCall["durable_commits"] = math.NaN()
	if s.WAL != nil {
		s.PerCall["durable_commits"] = float64(s.WAL["Transaction/COMMIT"].Count) / n
	}
	return s
}

// analyse fills in the comparisons, the targets and the failures.
func (r *report) analyse(vs []*variant, cfg config) {
	r.Variants = vs
	sums := map[string]summary{}
	byName := map[string]*variant{}
	for _, v := range vs {
		sums[v.Name] = v.summary()
		byName[v.Name] = v
		for _, s := range v.Slots {
			r.Failures = append(r.Failures, s.Problems...)
		}
	}
	compare := func(scenario, a, b string) {
		va, vb := byName[a], byName[b]
		if va == nil || vb == nil {
			return
		}
		c := comparison{Scenario: scenario, A: a, B: b, Label: a + " / " + b}
		c.Rate = sums[a].Rate / sums[b].Rate
		c.P50Ratio, c.P99Ratio = sums[a].P50/sums[b].P50, sums[a].P99/sums[b].P99
		c.RateRounds, c.RateMin, c.RateMax = spread(roundRatios(va, vb, slotResult.rate))
		r.Comparisons = append(r.Comparisons, c)
	}
	for _, h := range []string{"", "/payments"} {
		compare("fresh", "fresh"+h, "floor"+h)
		compare("fresh", "fresh"+h, "plain"+h)
		compare("fresh", "floor"+h, "plain"+h)
	}
	for _, h := range []string{"", "/payments"} {
		compare("engine", "engine:execute"+h, "engine:floor"+h)
		compare("engine", "engine:execute"+h, "engine:plain"+h)
		compare("engine", "engine:floor"+h, "engine:plain"+h)
	}
	pre := "fresh-" + humanCount(cfg.Preload)
	compare("replay", "replay", "plain")
	compare("replay", "replay", "no-db")
	compare("replay", "replay", "fresh")
	compare("replay", "unmarked-replay", "replay")
	compare("contended", "contended", "plain")
	compare("contended", "contended", "fresh")
	compare("nokey", "no-key", "no-db")
	compare("http", "http-fresh", "http-plain")
	compare("http", "http-plain", "plain")
	compare("preload", pre, "fresh")
	compare("preload", pre+"+cleaner", pre)
	r.targets(byName, sums, cfg)
	for _, v := range vs {
		if sums[v.Name].Tainted {
			r.Notes = append(r.Notes, "* The server was shared during some of these runs: other databases committed "+
				"transactions, or other sessions were connected to the bench database. Cluster-wide figures (durable "+
				"commits, WAL, fsyncs, transaction IDs) then include others' work, and so do the database's commit "+
				"counts if those sessions were busy; round trips and traced figures are the tool's alone.")
			break
		}
	}
}

// roundRatios is f of a over f of b, round by round: both ran in the same
// round, next to each other, so drift of the machine cancels out.
func roundRatios(a, b *variant, f func(slotResult) float64) []float64 {
	var xs []float64
	for i := range min(len(a.Slots), len(b.Slots)) {
		xs = append(xs, f(a.Slots[i])/f(b.Slots[i]))
	}
	return xs
}

// spread is the median and the range of xs.
func spread(xs []float64) (med, lo, hi float64) {
	if len(xs) == 0 {
		return math.NaN(), math.NaN(), math.NaN()
	}
	return median(xs), slices.Min(xs), slices.Max(xs)
}

func walPerCall(s slotResult) float64 { return float64(s.DB.PG.WALBytes) / float64(s.Calls) }

// targets checks the goals of the issue against this run's figures. Each
// goal is stated for fresh calls through gRPC against a baseline measured
// in the same rounds; the engine-only pair (no gRPC) is shown beside it,
// and stands in for it when the run has no gRPC variants.
func (r *report) targets(byName map[string]*variant, sums map[string]summary, cfg config) {
	addStatus := func(goal, status, format string, a ...any) {
		r.Targets = append(r.Targets, target{Goal: goal, Status: status, Measured: fmt.Sprintf(format, a...)})
	}
	met := func(ok bool) string {
		if ok {
			return "met"
		}
		return "MISSED"
	}
	// An inexact commit count is an upper bound (others' commits, or
	// read-only ones, can only add to it), so a figure over the goal is
	// unsure rather than missed.
	commitStatus := func(c, goal float64, exact bool) string {
		switch {
		case math.Abs(c-goal) < 0.02:
			return "met"
		case c > goal && !exact:
			return "unsure"
		}
		return "MISSED"
	}
	perCall := func(name, k string) float64 { return sums[name].PerCall[k] }
	clients := ""
	if cfg.Clients != 8 {
		clients = fmt.Sprintf("; stated for 8 clients, this run used %d", cfg.Clients)
	}
	// pair is fresh and a baseline, through gRPC or engine only.
	type pair struct{ a, b, via string }
	pairs := func(h, baseline string) []pair {
		var ps []pair
		for _, p := range []pair{{"fresh" + h, baseline + h, ""}, {"engine:execute" + h, "engine:" + baseline + h, "engine only"}} {
			if byName[p.a] != nil && byName[p.b] != nil {
				ps = append(ps, p)
			}
		}
		return ps
	}
	// goalFor names the goal; the figures of the first pair decide it.
	goalFor := func(goal, handler string, ps []pair) string {
		goal += ", " + handler + " handler"
		if ps[0].via != "" {
			goal += " (engine only: the run has no gRPC variants)"
		}
		return goal
	}
	for _, h := range []struct{ sfx, name string }{{"", "trivial"}, {"/payments", "payments"}} {
		if ps := pairs(h.sfx, "floor"); len(ps) > 0 {
			// The targets of the row claim: through gRPC 0.82x the floor,
			// the engine alone 0.78x (PostgreSQL's own ceiling for its
			// statements, from internal/bench/pgbench, is about 0.80x).
			for _, p := range ps {
				goal, target := "fresh throughput through gRPC >= 0.82x floor", 0.82
				if p.via != "" {
					goal, target = "fresh throughput, engine alone, >= 0.78x floor", 0.78
				}
				med, lo, hi := spread(roundRatios(byName[p.a], byName[p.b], slotResult.rate))
				addStatus(goal+", "+h.name+" handler", met(med >= target), "%.2fx (rounds %.2f-%.2f; %.0f vs %.0f calls/s)%s",
					med, lo, hi, sums[p.a].Rate, sums[p.b].Rate, clients)
			}
			if p := ps[len(ps)-1]; strings.HasPrefix(p.a, "engine:") {
				a, b := perCall(p.a, "go_cpu_us"), perCall(p.b, "go_cpu_us")
				addStatus("Go CPU per fresh call, engine alone, <= 1.15x floor's, "+h.name+" handler", met(a <= 1.15*b),
					"%.2fx: %.0f vs %.0f µs per call (clients included)", a/b, a, b)
			}
		}
		if ps := pairs(h.sfx, "plain"); len(ps) > 0 {
			var parts []string
			for i, p := range ps {
				part := fmt.Sprintf("%.2f vs %.2f", perCall(p.a, "round_trips"), perCall(p.b, "round_trips"))
				if f := strings.Replace(p.b, "plain", "floor", 1); byName[f] != nil {
					part += fmt.Sprintf(" (floor %.2f)", perCall(f, "round_trips"))
				}
				if i > 0 {
					part = p.via + " " + p.a + " vs " + p.b + ": " + part
				}
				parts = append(parts, part)
			}
			p := ps[0]
			addStatus(goalFor("round trips per fresh first attempt == plain's", h.name, ps),
				met(math.Abs(perCall(p.a, "round_trips")-perCall(p.b, "round_trips")) < 0.02), "%s", strings.Join(parts, "; "))
		}
		if ps := pairs(h.sfx, "floor"); len(ps) > 0 {
			var parts []string
			var first float64
			for i, p := range ps {
				med, lo, hi := spread(roundRatios(byName[p.a], byName[p.b], walPerCall))
				part := fmt.Sprintf("%.2fx (rounds %.2f-%.2f): %.0f vs %.0f bytes/call", med, lo, hi,
					perCall(p.a, "wal_bytes"), perCall(p.b, "wal_bytes"))
				if i == 0 {
					first = med
				} else {
					part = p.via + " " + p.a + " / " + p.b + ": " + part
				}
				parts = append(parts, part)
			}
			// The claim's row is written twice (its INSERT, then the
			// result's heap-only UPDATE), where the floor writes one.
			status := met(first <= 1.30)
			if status != "met" && (sums[ps[0].a].Tainted || sums[ps[0].b].Tainted) {
				status = "unsure" // others' WAL may be in either figure
			}
			addStatus(goalFor("WAL bytes per fresh call <= floor's + 30%", h.name, ps), status, "%s", strings.Join(parts, "; "))
		}
		var fresh []string
		for _, name := range []string{"fresh" + h.sfx, "engine:execute" + h.sfx} {
			if byName[name] != nil {
				fresh = append(fresh, name)
			}
		}
		if len(fresh) > 0 {
			var parts []string
			var status string
			for i, name := range fresh {
				c, src, exact := durableCommits(sums[name])
				part := fmt.Sprintf("%.3f durable (%s); %.2f transactions in all", c, src, perCall(name, "transactions"))
				if i == 0 {
					status = commitStatus(c, 1, exact)
				} else {
					part = "engine only " + name + ": " + part
				}
				parts = append(parts, part)
			}
			goal := "one durable commit per fresh call, " + h.name + " handler"
			if fresh[0] != "fresh"+h.sfx {
				goal += " (engine only: the run has no gRPC variants)"
			}
			addStatus(goal, status, "%s", strings.Join(parts, "; "))
		}
	}
	if byName["replay"] != nil {
		rt := perCall("replay", "round_trips")
		other := ""
		if byName["unmarked-replay"] != nil {
			other = fmt.Sprintf("; unmarked-replay (no retry marker) %.2f", perCall("unmarked-replay", "round_trips"))
		}
		addStatus("replay (x-retry-attempt: 1): one round trip per call", met(math.Abs(rt-1) < 0.02), "%.2f%s", rt, other)

		c, src, exact := durableCommits(sums["replay"])
		begins, rollbacks := perCall("replay", "traced_begins"), perCall("replay", "rollbacks")
		status := commitStatus(c, 0, exact)
		if begins > 0.01 || rollbacks > 0.01 {
			status = "MISSED"
		}
		other = ""
		if byName["unmarked-replay"] != nil {
			other = fmt.Sprintf("; unmarked-replay %.2f transaction blocks, %.2f rollbacks", perCall("unmarked-replay", "traced_begins"),
				perCall("unmarked-replay", "rollbacks"))
		}
		addStatus("replay: no transaction per call (no BEGIN, no COMMIT or ROLLBACK)", status,
			"%.2f transaction blocks, %.2f rollbacks, %.3f durable commits (%s); its one SELECT counts as %.2f "+
				"single-statement read-only transaction in pg_stat_database%s", begins, rollbacks, c, src, perCall("replay", "commits"), other)
	}
	if v := byName["proxy-resend"]; v != nil {
		var calls, executed, replayed int64
		for _, r := range v.Slots {
			calls += r.Calls - r.Errors
			executed += r.DB.Outcomes[idempotency.OutcomeExecuted]
			replayed += r.DB.Outcomes[idempotency.OutcomeReplayed]
		}
		addStatus("proxy resend of a finished key (idempotency-key-new: true, no retry marker): replayed, the handler never runs",
			met(executed == 0 && replayed == calls), "%d calls: %d replayed, %d executed; %.2f round trips per call", calls, replayed, executed,
			perCall("proxy-resend", "round_trips"))
	}
	// No goal for HTTP: its fresh/plain ratio is shown beside gRPC's, to
	// tell the middleware's cost from the interceptor's.
	if byName["http-fresh"] != nil && byName["http-plain"] != nil {
		var parts []string
		for _, p := range []pair{{"http-fresh", "http-plain", "HTTP"}, {"fresh", "plain", "gRPC"}} {
			if byName[p.a] == nil || byName[p.b] == nil {
				continue
			}
			med, lo, hi := spread(roundRatios(byName[p.a], byName[p.b], slotResult.rate))
			parts = append(parts, fmt.Sprintf("%s %s / %s %.2fx (rounds %.2f-%.2f; %.0f vs %.0f calls/s)",
				p.via, p.a, p.b, med, lo, hi, sums[p.a].Rate, sums[p.b].Rate))
		}
		addStatus("fresh / plain throughput, HTTP beside gRPC, trivial handler", "reported", "%s", strings.Join(parts, "; "))
	}
}

// durableCommits is the commits per call that wrote a WAL commit record,
// and where the figure comes from. It is an upper bound, not exact, when
// the server was shared or pg_walinspect was missing.
func durableCommits(s summary) (c float64, src string, exact bool) {
	c = s.PerCall["durable_commits"]
	switch {
	case math.IsNaN(c):
		return s.PerCall["traced_commits"], "pg_walinspect unavailable: traced commits, read-only transactions included", false
	case s.Tainted:
		return c, "WAL commit records; the server was shared, so they include other sessions' commits", false
	}
	return c, "WAL commit records", true
}

// targetsTitle heads the targets table; the test looks for it.
const targetsTitle = "Targets: fresh calls against the floor of a durable key"

// table is a titled grid, rendered as aligned text or as markdown.
type table struct {
	title  string
	header []string
	rows   [][]string
	notes  []string
}

func (r *report) tables() []table {
	sums := map[string]summary{}
	for _, v := range r.Variants {
		sums[v.Name] = v.summary()
	}
	mark := func(name string) string {
		if sums[name].Tainted {
			return "*"
		}
		return ""
	}
	var out []table

	t := table{title: fmt.Sprintf("Throughput and latency: medians of %d rounds", r.Config.Rounds),
		header: []string{"variant", "calls/s", "p50", "p99", "calls", "CPU/call: Go", "PostgreSQL", "what it is"},
		notes:  []string{"CPU/call: user and system time of this process (clients and servers together) and of the pools' PostgreSQL backends (from /proc; not WAL writer, checkpointer or other server processes)."}}
	for _, v := range r.Variants {
		s := sums[v.Name]
		pgCPU := "-"
		if x := s.PerCall["pg_cpu_us"]; !math.IsNaN(x) {
			pgCPU = fmt.Sprintf("%.0fµs", x)
		}
		t.rows = append(t.rows, []string{v.Name, fmt.Sprintf("%.0f", s.Rate), fmtSec(s.P50), fmtSec(s.P99), fmt.Sprint(s.Calls),
			fmt.Sprintf("%.0fµs", s.PerCall["go_cpu_us"]), pgCPU, v.About})
	}
	out = append(out, t)

	t = table{title: "Ratios: median against median, and the median and range of the per-round ratios",
		header: []string{"scenario", "variant / baseline", "calls/s", "per round", "range", "p50", "p99"}}
	for _, c := range r.Comparisons {
		t.rows = append(t.rows, []string{c.Scenario, c.Label, fmt.Sprintf("%.2fx", c.Rate), fmt.Sprintf("%.2fx", c.RateRounds),
			fmt.Sprintf("%.2f-%.2f", c.RateMin, c.RateMax), fmt.Sprintf("%.2fx", c.P50Ratio), fmt.Sprintf("%.2fx", c.P99Ratio)})
	}
	out = append(out, t)

	f2 := func(x float64) string {
		if math.IsNaN(x) {
			return "-"
		}
		return fmt.Sprintf("%.2f", x)
	}
	t = table{title: "Round trips and transactions per call (all rounds)",
		header: []string{"variant", "round trips", "traced", "statements", "transaction blocks", "durable commits", "commits", "rollbacks", "traced commits", "traced rollbacks"},
		notes: []string{
			"round trips: writes to PostgreSQL that follow a read, counted on the pool's sockets; traced: what pgx was asked for, a statement, a batch or a Prepare being one each.",
			"transaction blocks: BEGIN statements, as the pgx tracer saw them; a statement run by itself is not one.",
			"durable commits: Transaction/COMMIT records in the WAL (pg_walinspect), i.e. commits of transactions that wrote; cluster-wide.",
			"commits, rollbacks: pg_stat_database of the bench database, less the tool's own statistics queries; read-only transactions count (a SELECT outside a transaction is one).",
			"traced commits, rollbacks: COMMIT and ROLLBACK, and statements or batches run outside a transaction block, as the pgx tracer saw them.",
		}}
	for _, v := range r.Variants {
		p := sums[v.Name].PerCall
		t.rows = append(t.rows, []string{v.Name + mark(v.Name),
			f2(p["round_trips"]), f2(p["traced_round_trips"]), f2(p["statements"]), f2(p["traced_begins"]), f2(p["durable_commits"]),
			f2(p["commits"]), f2(p["rollbacks"]), f2(p["traced_commits"]), f2(p["traced_rollbacks"])})
	}
	for _, v := range r.Variants {
		if p := sums[v.Name].PerCall; v.keys == sharedKey {
			t.notes = append(t.notes, fmt.Sprintf("%s: %.0f%% of calls executed, %.0f%% got a duplicate's result; its figures are the mix.",
				v.Name, 100*p["executed"], 100*p["replayed"]))
		}
	}
	t.notes = append(t.notes, r.Notes...)
	out = append(out, t)

	t = table{title: "Writes per call (all rounds)",
		header: []string{"variant", "WAL bytes", "full-page images", "WAL fsyncs", "xids", "dead tuples: keys", "business", "HOT updates", "bytes to/from PG"},
		notes: []string{
			"WAL bytes: pg_current_wal_lsn; full-page images and fsyncs: pg_stat_wal (concurrent commits can share an fsync); xids: transaction IDs assigned, subtransactions included. All cluster-wide.",
			"dead tuples: growth of pg_stat_user_tables.n_dead_tup in the key tables (the floor's included) and the business tables (ledger; accounts and charges); HOT updates: share of key-table updates that were heap-only.",
		}}
	for _, v := range r.Variants {
		p := sums[v.Name].PerCall
		hot := "-"
		if p["key_updates"] > 0 {
			hot = fmt.Sprintf("%.0f%%", 100*p["key_hot_updates"]/p["key_updates"])
		}
		t.rows = append(t.rows, []string{v.Name + mark(v.Name),
			fmt.Sprintf("%.0f", p["wal_bytes"]), f2(p["wal_fpi"]), f2(p["wal_fsyncs"]), f2(p["xids"]),
			f2(p["dead_keys"]), f2(p["dead_business"]), hot, fmt.Sprintf("%.0f/%.0f", p["bytes_to_pg"], p["bytes_from_pg"])})
	}
	if r.Preload != nil {
		t.notes = append(t.notes, fmt.Sprintf("preload: %d keys (%s with indexes) inserted in %v, vacuumed and checkpointed in %v.",
			r.Preload.Keys, r.Preload.Size, r.Preload.Insert.Round(time.Second/10), r.Preload.Vacuum.Round(time.Second/10)))
	}
	out = append(out, t)

	t = table{title: "WAL per call by record type (pg_walinspect; the largest six of each variant)",
		header: []string{"variant", "record type", "records", "bytes"}}
	for _, v := range r.Variants {
		s := sums[v.Name]
		var types []string
		for name, w := range s.WAL {
			if float64(w.Bytes)/float64(s.Calls) >= 1 { // less is someone else's, or nothing
				types = append(types, name)
			}
		}
		slices.SortFunc(types, func(a, b string) int { return cmp.Compare(s.WAL[b].Bytes, s.WAL[a].Bytes) })
		for i, name := range types[:min(6, len(types))] {
			w := s.WAL[name]
			row := []string{"", name, f2(float64(w.Count) / float64(s.Calls)), fmt.Sprintf("%.0f", float64(w.Bytes)/float64(s.Calls))}
			if i == 0 {
				row[0] = v.Name + mark(v.Name)
			}
			t.rows = append(t.rows, row)
		}
	}
	if len(t.rows) > 0 {
		out = append(out, t)
	}

	t = table{title: fmt.Sprintf("Round trips of one call: %d calls of each variant, one at a time", r.Config.Probe),
		header: []string{"variant", "calls", "round trips", "#", "statements (a batch is one round trip)"}}
	for _, v := range r.Variants {
		for _, s := range v.Probe {
			steps := s.Steps
			if len(steps) == 0 {
				steps = []string{"(no statements)"}
			}
			for i, st := range steps {
				row := []string{"", "", "", fmt.Sprint(i + 1), st}
				if i == 0 {
					row[0], row[1], row[2] = v.Name, fmt.Sprint(s.Calls), fmt.Sprint(s.RoundTrips)
				}
				t.rows = append(t.rows, row)
			}
		}
	}
	if len(t.rows) > 0 {
		out = append(out, t)
	}

	t = table{title: targetsTitle, header: []string{"", "goal", "measured"},
		notes: []string{
			"Ratios are medians of the per-round ratios: a variant and its baseline run in the same round, one after the other; the range is of the per-round ratios.",
			"floor: no interceptor; BEGIN, the handler's write, then the key row the engine would write (same table definition and values) and COMMIT in one batch. No lock, no lookup, no deduplication.",
			"engine only: the same handlers run by -clients goroutines against PostgreSQL, without gRPC (engine:execute is Store.Execute, engine:floor the floor).",
		}}
	for _, g := range r.Targets {
		t.rows = append(t.rows, []string{g.Status, g.Goal, g.Measured})
	}
	out = append(out, t)
	return out
}

func (r *report) header() []string {
	c := r.Config
	h := []string{r.Command}
	h = append(h, r.Environment...)
	h = append(h, fmt.Sprintf("%d clients (each with one gRPC connection to each server and one keep-alive HTTP connection), server pool of %d, %d-byte responses, %s keys; "+
		"%d rounds of %v per variant after a %v warm-up; a round runs every variant once, in the order below",
		c.Clients, c.Pool, c.ResponseBytes, c.KeyKind, c.Rounds, c.Duration, c.Warmup))
	return h
}

func (r *report) writeText(w io.Writer) error {
	for _, l := range r.header() {
		fmt.Fprintln(w, l)
	}
	for _, t := range r.tables() {
		fmt.Fprintf(w, "\n%s\n", t.title)
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, strings.Join(t.header, "\t"))
		for _, row := range t.rows {
			fmt.Fprintln(tw, strings.Join(row, "\t"))
		}
		if err := tw.Flush(); err != nil {
			return err
		}
		for _, n := range t.notes {
			fmt.Fprintln(w, "  "+n)
		}
	}
	return nil
}

func (r *report) writeMarkdown(w io.Writer) error {
	fmt.Fprintf(w, "```\n%s\n```\n\n", r.Command)
	for _, l := range r.header()[1:] {
		fmt.Fprintf(w, "- %s\n", l)
	}
	cell := func(s string) string { return strings.ReplaceAll(s, "|", `\|`) }
	for _, t := range r.tables() {
		fmt.Fprintf(w, "\n**%s**\n\n", t.title)
		hdr := make([]string, len(t.header))
		sep := make([]string, len(t.header))
		for i, h := range t.header {
			hdr[i], sep[i] = cell(h), "---"
		}
		fmt.Fprintf(w, "| %s |\n| %s |\n", strings.Join(hdr, " | "), strings.Join(sep, " | "))
		for _, row := range t.rows {
			cells := make([]string, len(row))
			for i, c := range row {
				cells[i] = cell(c)
				if i == len(row)-1 && strings.HasPrefix(t.header[len(t.header)-1], "statements") {
					cells[i] = "`" + cells[i] + "`"
				}
			}
			fmt.Fprintf(w, "| %s |\n", strings.Join(cells, " | "))
		}
		if len(t.notes) > 0 {
			fmt.Fprintln(w)
		}
		for _, n := range t.notes {
			fmt.Fprintf(w, "- %s\n", n)
		}
	}
	return nil
}

func (r *report) writeJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(r)
}

// environment describes the machine and the server, for the report.
func (b *bench) environment(ctx context.Context) []string {
	cpu := "unknown CPU"
	if data, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, l := range strings.Split(string(data), "\n") {
			if name, ok := strings.CutPrefix(l, "model name"); ok {
				cpu = strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(name), ":"))
				break
			}
		}
	}
	env := []string{fmt.Sprintf("%s %s/%s; %d CPUs (%s), GOMAXPROCS %d; clients, servers and PostgreSQL share the machine",
		runtime.Version(), runtime.GOOS, runtime.GOARCH, runtime.NumCPU(), cpu, runtime.GOMAXPROCS(0))}
	var settings []string
	for _, name := range []string{"server_version", "fsync", "synchronous_commit", "wal_sync_method", "full_page_writes", "shared_buffers", "autovacuum"} {
		var v string
		if err := b.stats.conn.QueryRow(ctx, "SELECT current_setting($1)", name).Scan(&v); err != nil {
			v = "?"
		}
		settings = append(settings, name+" "+v)
	}
	return append(env, "PostgreSQL: "+strings.Join(settings, ", "))
}

func fmtSec(s float64) string {
	if math.IsNaN(s) {
		return "-"
	}
	return fmtDur(time.Duration(s * float64(time.Second)))
}

func fmtDur(d time.Duration) string {
	switch {
	case d >= time.Second:
		return fmt.Sprintf("%.2fs", d.Seconds())
	case d >= time.Millisecond:
		return fmt.Sprintf("%.2fms", float64(d)/float64(time.Millisecond))
	}
	return fmt.Sprintf("%.0fµs", float64(d)/float64(time.Microsecond))
}
