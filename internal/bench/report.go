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
	Scenario string  `json:"scenario"`
	A, B     string  `json:"-"`
	Label    string  `json:"label"`
	Rate     float64 `json:"throughput_ratio"`     // median A / median B
	RateMin  float64 `json:"throughput_ratio_min"` // of the per-round ratios
	RateMax  float64 `json:"throughput_ratio_max"`
	P50Ratio float64 `json:"p50_ratio"`
	P99Ratio float64 `json:"p99_ratio"`
}

// target is one of issue 6's goals with the figure measured for it.
type target struct {
	Goal     string `json:"goal"`
	Measured string `json:"measured"`
	Status   string `json:"status"` // met, MISSED, or unsure: over the goal by no more than others' work could explain
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
	keys := sum.PG.Tables["idempotency_keys"]
	pre := sum.PG.Tables[preloadedTable]
	ledger := sum.PG.Tables["ledger"]
	for k, x := range map[string]int64{
		"round_trips": sum.Wire.RoundTrips, "traced_round_trips": sum.Trace.RoundTrips,
		"statements": sum.Trace.Statements, "prepares": sum.Trace.Prepares, "connects": sum.Trace.Connects,
		"commits": sum.PG.Commits, "traced_commits": sum.Trace.Commits, "transactions": sum.PG.Commits + sum.PG.Rollbacks,
		"rollbacks": sum.PG.Rollbacks, "traced_rollbacks": sum.Trace.Rollbacks,
		"wal_bytes": sum.PG.WALBytes, "wal_fpi": sum.PG.WALFPI, "wal_fsyncs": sum.PG.WALSyncs, "xids": sum.PG.Xids,
		"bytes_to_pg": sum.Wire.BytesOut, "bytes_from_pg": sum.Wire.BytesIn,
		"dead_keys": keys.Dead + pre.Dead, "dead_ledger": ledger.Dead,
		"key_updates": keys.Upd + pre.Upd, "key_hot_updates": keys.HotUpd + pre.HotUpd,
		"key_deletes": keys.Del + pre.Del, "vacuums": keys.Vacuums + pre.Vacuums + ledger.Vacuums,
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
	compare := func(scenario, a, b string) *comparison {
		va, vb := byName[a], byName[b]
		if va == nil || vb == nil {
			return nil
		}
		c := comparison{Scenario: scenario, A: a, B: b, Label: a + " / " + b}
		c.Rate = sums[a].Rate / sums[b].Rate
		c.P50Ratio, c.P99Ratio = sums[a].P50/sums[b].P50, sums[a].P99/sums[b].P99
		c.RateMin, c.RateMax = math.Inf(1), math.Inf(-1)
		for i := range min(len(va.Slots), len(vb.Slots)) {
			x := va.Slots[i].rate() / vb.Slots[i].rate()
			c.RateMin, c.RateMax = min(c.RateMin, x), max(c.RateMax, x)
		}
		r.Comparisons = append(r.Comparisons, c)
		return &r.Comparisons[len(r.Comparisons)-1]
	}
	pre := "fresh-" + humanCount(cfg.Preload)
	fresh := compare("fresh", "fresh", "plain")
	compare("replay", "replay", "plain")
	replayNoDB := compare("replay", "replay", "no-db")
	replayFresh := compare("replay", "replay", "fresh")
	compare("contended", "contended", "plain")
	compare("contended", "contended", "fresh")
	noKey := compare("nokey", "no-key", "no-db")
	preloaded := compare("preload", pre, "fresh")
	cleaner := compare("preload", pre+"+cleaner", pre)

	addStatus := func(goal, status, format string, a ...any) {
		r.Targets = append(r.Targets, target{Goal: goal, Status: status, Measured: fmt.Sprintf(format, a...)})
	}
	add := func(goal string, met bool, format string, a ...any) {
		status := "met"
		if !met {
			status = "MISSED"
		}
		addStatus(goal, status, format, a...)
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
	if fresh != nil {
		goal := "fresh throughput >= 0.85x plain"
		if cfg.Clients != 8 {
			goal += fmt.Sprintf(" (stated for 8 clients; this run used %d)", cfg.Clients)
		}
		add(goal, fresh.Rate >= 0.85, "%.2fx (rounds %.2f-%.2f)", fresh.Rate, fresh.RateMin, fresh.RateMax)
		add("round trips per fresh call <= plain's + 1", perCall("fresh", "round_trips") <= perCall("plain", "round_trips")+1.02,
			"%.2f vs plain %.2f", perCall("fresh", "round_trips"), perCall("plain", "round_trips"))
	}
	if _, ok := byName["fresh"]; ok {
		c, src, exact := durableCommits(sums["fresh"])
		addStatus("one commit per fresh call", commitStatus(c, 1, exact), "%.3f durable (%s); %.2f transactions in all", c, src, perCall("fresh", "transactions"))
	}
	if _, ok := byName["replay"]; ok {
		c, src, exact := durableCommits(sums["replay"])
		addStatus("no commit per replay", commitStatus(c, 0, exact), "%.3f durable (%s); %.2f transactions in all", c, src, perCall("replay", "transactions"))
		add("one round trip per replay", math.Abs(perCall("replay", "round_trips")-1) < 0.02, "%.2f", perCall("replay", "round_trips"))
	}
	if replayFresh != nil {
		add("replay throughput >= 3x fresh", replayFresh.Rate >= 3, "%.2fx (rounds %.2f-%.2f)", replayFresh.Rate, replayFresh.RateMin, replayFresh.RateMax)
	}
	if replayNoDB != nil {
		add("replay latency within 2x a no-database call", replayNoDB.P50Ratio <= 2,
			"p50 %.2fx (%s vs %s), p99 %.2fx", replayNoDB.P50Ratio, fmtSec(sums["replay"].P50), fmtSec(sums["no-db"].P50), replayNoDB.P99Ratio)
	}
	if noKey != nil {
		add("pass-through overhead < 5%", noKey.Rate > 0.95, "%+.1f%% calls/s (rounds %+.1f%% to %+.1f%%)",
			100*(noKey.Rate-1), 100*(noKey.RateMin-1), 100*(noKey.RateMax-1))
	}
	if preloaded != nil {
		goal := "fresh throughput with 10M keys in the table >= 0.9x the small table"
		if cfg.Preload != 10_000_000 {
			goal += fmt.Sprintf(" (this run: %s keys)", humanCount(cfg.Preload))
		}
		add(goal, preloaded.Rate >= 0.9, "%.2fx (rounds %.2f-%.2f)", preloaded.Rate, preloaded.RateMin, preloaded.RateMax)
	}
	if cleaner != nil {
		deleted := perCall(pre+"+cleaner", "key_deletes") * sums[pre+"+cleaner"].Rate
		add("the expiry cleaner running meanwhile costs < 10%", cleaner.Rate > 0.9,
			"%+.1f%% calls/s (rounds %+.1f%% to %+.1f%%) while it deleted about %.0f keys/s", 100*(cleaner.Rate-1),
			100*(cleaner.RateMin-1), 100*(cleaner.RateMax-1), deleted)
	}
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

	t = table{title: "Ratios: median against median; the range is of the per-round ratios",
		header: []string{"scenario", "variant / baseline", "calls/s", "range", "p50", "p99"}}
	for _, c := range r.Comparisons {
		t.rows = append(t.rows, []string{c.Scenario, c.Label, fmt.Sprintf("%.2fx", c.Rate),
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
		header: []string{"variant", "round trips", "traced", "statements", "durable commits", "commits", "rollbacks", "traced commits", "traced rollbacks"},
		notes: []string{
			"round trips: writes to PostgreSQL that follow a read, counted on the pool's sockets; traced: what pgx was asked for, a statement, a batch or a Prepare being one each.",
			"durable commits: Transaction/COMMIT records in the WAL (pg_walinspect), i.e. commits of transactions that wrote; cluster-wide.",
			"commits, rollbacks: pg_stat_database of the bench database, less the tool's own statistics queries; read-only transactions count (a SELECT outside a transaction is one).",
			"traced commits, rollbacks: COMMIT and ROLLBACK, and statements or batches run outside a transaction block, as the pgx tracer saw them.",
		}}
	for _, v := range r.Variants {
		p := sums[v.Name].PerCall
		t.rows = append(t.rows, []string{v.Name + mark(v.Name),
			f2(p["round_trips"]), f2(p["traced_round_trips"]), f2(p["statements"]), f2(p["durable_commits"]),
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
		header: []string{"variant", "WAL bytes", "full-page images", "WAL fsyncs", "xids", "dead tuples: keys", "ledger", "HOT updates", "bytes to/from PG"},
		notes: []string{
			"WAL bytes: pg_current_wal_lsn; full-page images and fsyncs: pg_stat_wal (concurrent commits can share an fsync); xids: transaction IDs assigned, subtransactions included. All cluster-wide.",
			"dead tuples: growth of pg_stat_user_tables.n_dead_tup in the key table(s) and the business table; HOT updates: share of key-table updates that were heap-only.",
		}}
	for _, v := range r.Variants {
		p := sums[v.Name].PerCall
		hot := "-"
		if p["key_updates"] > 0 {
			hot = fmt.Sprintf("%.0f%%", 100*p["key_hot_updates"]/p["key_updates"])
		}
		t.rows = append(t.rows, []string{v.Name + mark(v.Name),
			fmt.Sprintf("%.0f", p["wal_bytes"]), f2(p["wal_fpi"]), f2(p["wal_fsyncs"]), f2(p["xids"]),
			f2(p["dead_keys"]), f2(p["dead_ledger"]), hot, fmt.Sprintf("%.0f/%.0f", p["bytes_to_pg"], p["bytes_from_pg"])})
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

	t = table{title: "Targets of issue 6", header: []string{"", "goal", "measured"}}
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
	h = append(h, fmt.Sprintf("%d clients (one gRPC connection each), server pool of %d, %d-byte responses, %s keys; "+
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
