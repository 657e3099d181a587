package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/exactlyonce/idempotency/internal/dburl"
)

const verifyUsage = `usage: idempotency [flags] verify [verify flags] -http URL | -grpc ADDR -method /pkg.Service/Method

Runs a battery of checks against a running service that takes idempotency
keys (this library's interceptor or middleware, or any server that speaks
the IETF Idempotency-Key header or the gRPC metadata key idempotency-key),
prints a table of them, and exits 1 if any failed.

What it sends: the request you give (-d, or -request), under fresh random
keys (verify-<random>), about 6 + n times; once without a key; and once the
request changed (-other-body or -other-request; by default a JSON member
"verify_other" added to the JSON body), under a key already used. The
service executes four or five operations, so point it at a test deployment or
use requests whose effect is harmless. It refuses a target that is not on
loopback or a private network unless given -allow-remote.

Checks:
  lost reply       the first answer, which the tool drops after the server sent it,
                   comes back byte for byte to a retry with the same key, marked as a
                   replay (the marker is this library's: Idempotency-Replayed, the
                   idempotency-replayed trailer; another server may not send it)
  duplicates       n requests with one key at once all get one answer (those answered
                   "in progress" are sent again until answered), and one of them ran
  in flight        a duplicate sent while the first is running is answered "in
                   progress" (409, Aborted) or gets the first's answer
  key reused       the key with another request is refused (422, FailedPrecondition)
  callers apart    with -H2 (a second caller's headers): the first check's key sent as
                   that caller does not get the first caller's answer (scopes per caller)
  no key           a request without a key is refused (-key-policy required) or
                   served (optional); without -key-policy, what came back is shown
  effect once      with -effect-sql (and the global -database-url): the effect happened
                   once for each operation the checks executed, and never became
                   visible before its key's record (a handler that writes outside the
                   call's transaction; caught when the handler takes a moment after
                   its write); the key table is read from -schema and -table. Run it
                   where nothing else changes what -effect-sql counts meanwhile

verify flags:
`

// verifyConfig is what the verify command was asked to do.
type verifyConfig struct {
	httpURL, httpMethod, body, otherBody string
	headers, caller2                     http.Header
	grpcAddr, grpcMethod                 string
	request, otherRequest                string
	n                                    int
	jsonOut, allowRemote                 bool
	effectSQL, keyPolicy                 string
	timeout                              time.Duration
	descriptorFiles                      []string
	dbURL, schema, table                 string
}

// verifyCommand runs verify with args (after the command's name).
func verifyCommand(ctx context.Context, args []string, g verifyConfig, stdout, stderr io.Writer) int {
	cfg := g
	cfg.headers, cfg.caller2 = http.Header{}, http.Header{}
	fs := flag.NewFlagSet("idempotency verify", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(stderr, verifyUsage)
		fs.PrintDefaults()
	}
	fs.StringVar(&cfg.httpURL, "http", "", "the URL of an HTTP endpoint (this library's HTTP middleware, connect-go's Connect protocol, or any server of the IETF Idempotency-Key header)")
	fs.StringVar(&cfg.httpMethod, "X", http.MethodPost, "the HTTP method")
	fs.StringVar(&cfg.body, "d", "", "the HTTP request's body")
	fs.StringVar(&cfg.otherBody, "other-body", "", "another body for the same endpoint, for the key-reused check (default: -d with a JSON member \"verify_other\" added, which a server that ignores unknown members, connect-go's, reads as the same request: give it another value of a field)")
	fs.Func("H", "a header of every request, 'Name: value' (repeatable; e.g. Content-Type, Authorization)", headerFlag(cfg.headers))
	fs.Func("H2", "a header of a second caller ('Name: value', repeatable; e.g. its Authorization): the callers-apart check sends the first check's key as that caller, which must not get the first caller's answer", headerFlag(cfg.caller2))
	fs.StringVar(&cfg.grpcAddr, "grpc", "", "the address (host:port) of a gRPC server, plaintext")
	fs.StringVar(&cfg.grpcMethod, "method", "", "with -grpc: the full method, /pkg.Service/Method")
	fs.StringVar(&cfg.request, "request", "{}", "with -grpc: the request, as protobuf JSON")
	fs.StringVar(&cfg.otherRequest, "other-request", "", "with -grpc: another request for the key-reused check (default: the request with its first string field changed, or its first number)")
	fs.IntVar(&cfg.n, "n", 16, "duplicates sent at once")
	fs.BoolVar(&cfg.jsonOut, "json", false, "print the checks as JSON instead of a table")
	fs.BoolVar(&cfg.allowRemote, "allow-remote", false, "allow a target that is not on loopback or a private network")
	fs.StringVar(&cfg.effectSQL, "effect-sql", "", "a query returning one number that counts the effect (e.g. select count(*) from transfers), run on the global -database-url")
	fs.StringVar(&cfg.keyPolicy, "key-policy", "", "what a request without a key should get: required (refused) or optional (served); default: shown, not checked")
	fs.DurationVar(&cfg.timeout, "timeout", 10*time.Second, "the longest the tool waits for one answer, retries of an in-progress key included")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	misuse := func(format string, a ...any) int {
		fmt.Fprintf(stderr, "idempotency verify: %s\n", fmt.Sprintf(format, a...))
		return 2
	}
	switch {
	case fs.NArg() != 0:
		return misuse("takes only flags; run idempotency verify -h")
	case (cfg.httpURL == "") == (cfg.grpcAddr == ""):
		return misuse("needs one target: -http URL or -grpc ADDR")
	case cfg.grpcAddr != "" && cfg.grpcMethod == "":
		return misuse("-grpc needs -method /pkg.Service/Method")
	case cfg.n < 2:
		return misuse("-n must be at least 2")
	case cfg.keyPolicy != "" && cfg.keyPolicy != "required" && cfg.keyPolicy != "optional":
		return misuse("-key-policy is required or optional")
	case cfg.timeout <= 0:
		return misuse("-timeout must be positive")
	}
	host := cfg.grpcAddr
	if cfg.httpURL != "" {
		u, err := url.Parse(cfg.httpURL)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return misuse("-http needs an http:// or https:// URL, got %q", cfg.httpURL)
		}
		host = u.Hostname()
	}
	if !cfg.allowRemote {
		if err := localTarget(ctx, host); err != nil {
			return misuse("%v; give -allow-remote to verify it anyway (it sends requests that execute: see -h)", err)
		}
	}
	var tg target
	var err error
	if cfg.httpURL != "" {
		tg, err = newHTTPTarget(cfg)
	} else {
		tg, err = newGRPCTarget(ctx, cfg)
	}
	if err != nil {
		return misuse("%v", err)
	}
	defer tg.close()
	var effect *effectProbe
	if cfg.effectSQL != "" {
		if err := dburl.Check(cfg.dbURL); err != nil {
			fmt.Fprintf(stderr, "idempotency verify: %s\n", dburl.Scrub(err.Error(), cfg.dbURL))
			return 1
		}
		pool, err := pgxpool.New(ctx, cfg.dbURL)
		if err != nil {
			fmt.Fprintf(stderr, "idempotency verify: %s\n", dburl.Scrub(err.Error(), cfg.dbURL))
			return 1
		}
		defer pool.Close()
		table := pgx.Identifier{cfg.table}
		if cfg.schema != "" {
			table = pgx.Identifier{cfg.schema, cfg.table}
		}
		effect = &effectProbe{pool: pool, sql: cfg.effectSQL, table: table.Sanitize(), timeout: cfg.timeout}
		pctx, cancel := context.WithTimeout(ctx, cfg.timeout)
		err = pool.Ping(pctx)
		cancel()
		if err != nil {
			fmt.Fprintf(stderr, "idempotency verify: the database of -effect-sql (-database-url) cannot be reached: %s\n", dburl.Scrub(err.Error(), cfg.dbURL))
			return 1
		}
		if _, _, err := effect.read(ctx, nil); err != nil {
			return misuse("-effect-sql: %s", dburl.Scrub(err.Error(), cfg.dbURL))
		}
		if _, _, err := effect.read(ctx, []string{newKey()}); err != nil {
			return misuse("the key table %s, where the effect check looks for the keys' records: %s (give -schema and -table as the service's store has them)",
				effect.table, dburl.Scrub(err.Error(), cfg.dbURL))
		}
	}
	checks := runChecks(ctx, cfg, tg, effect)
	failed := false
	for _, c := range checks {
		failed = failed || c.Result == "FAIL"
	}
	if cfg.jsonOut {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		_ = enc.Encode(struct {
			Target string        `json:"target"`
			Passed bool          `json:"passed"`
			Checks []checkResult `json:"checks"`
		}{tg.describe(), !failed, checks})
	} else {
		fmt.Fprintf(stdout, "verify %s\n\n", tg.describe())
		w := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
		fmt.Fprintln(w, "CHECK\tRESULT\tSENT\tCAME BACK")
		for _, c := range checks {
			fmt.Fprintf(w, "%s\t%s\t%s\t%s\n", c.Check, c.Result, c.Sent, c.Got)
		}
		_ = w.Flush()
		for _, c := range checks {
			if c.Why != "" {
				fmt.Fprintf(stdout, "\n%s: %s\n", c.Check, c.Why)
			}
		}
		fmt.Fprintf(stdout, "\nverdict: %s\n", map[bool]string{false: "PASS", true: "FAIL"}[failed])
	}
	if failed {
		return 1
	}
	return 0
}

// headerFlag adds the value of a header flag, 'Name: value', to h.
func headerFlag(h http.Header) func(string) error {
	return func(v string) error {
		name, value, ok := strings.Cut(v, ":")
		if !ok || strings.TrimSpace(name) == "" {
			return fmt.Errorf("want 'Name: value', got %q", v)
		}
		h.Add(strings.TrimSpace(name), strings.TrimSpace(value))
		return nil
	}
}

// localTarget refuses a host that does not resolve to loopback or private
// addresses only.
func localTarget(ctx context.Context, hostport string) error {
	host, _, err := net.SplitHostPort(hostport)
	if err != nil {
		host = hostport
	}
	ips, err := net.DefaultResolver.LookupIPAddr(ctx, host)
	if err != nil {
		return fmt.Errorf("the target's host %q does not resolve: %v", host, err)
	}
	for _, ip := range ips {
		if !ip.IP.IsLoopback() && !ip.IP.IsPrivate() {
			return fmt.Errorf("the target %s is not on loopback or a private network (%s)", host, ip.IP)
		}
	}
	return nil
}

// answer is what one request got back.
type answer struct {
	code   string // the HTTP status or the gRPC code
	class  answerClass
	body   []byte // the HTTP body, or the gRPC response or status, encoded
	replay bool   // marked as a replay (this library's marker)
	reason string // this library's reason for its own answers (KEY_REUSED, ...)
	ok     bool   // a success (2xx, OK): the only answers whose effect commits
	err    error  // no answer at all
}

type answerClass int

const (
	noAnswer   answerClass = iota // no answer at all (err)
	answered                      // an answer of the service's
	inProgress                    // 409, Aborted: the key's first request is running
	keyReused                     // 422, FailedPrecondition KEY_REUSED
	keyRefused                    // 400, InvalidArgument: the key is missing or invalid
	failed                        // a 5xx, Unavailable, ...: no answer a retry would replay
)

func (a answer) String() string {
	if a.err != nil {
		return "error: " + a.err.Error()
	}
	s := a.code
	if a.replay {
		s += " (replay)"
	}
	return s
}

// target sends the request under test.
type target interface {
	// send sends the request (other: the changed one) under key ("": none),
	// as the second caller (-H2) when caller2.
	send(ctx context.Context, key string, other, caller2 bool) answer
	describe() string
	close()
}

// checkResult is one row of the report.
type checkResult struct {
	Check  string `json:"check"`
	Result string `json:"result"` // PASS, FAIL, INFO
	Sent   string `json:"sent"`
	Got    string `json:"came_back"`
	Why    string `json:"why,omitempty"`
}

// newKey is a fresh random key.
func newKey() string { return "verify-" + strings.ToLower(rand.Text()) }

// runChecks runs every check against tg, in order.
func runChecks(ctx context.Context, cfg verifyConfig, tg target, effect *effectProbe) []checkResult {
	var results []checkResult
	executed := 0 // operations that ran, for the effect check
	var before int64
	if effect != nil {
		before, _, _ = effect.read(ctx, nil)
	}
	// own is an answer to a key of the checks' own request: "key reused"
	// cannot be (the key was never used with another request), so such an
	// answer is the service's own (a handler's FailedPrecondition).
	own := func(a answer) answer {
		if a.class == keyReused {
			a.class = answered
		}
		return a
	}
	// answerOf sends until the key is not in progress (the timeout bounds it).
	answerOf := func(key string) answer {
		deadline := time.Now().Add(cfg.timeout)
		for {
			a := own(tg.send(ctx, key, false, false))
			if a.class != inProgress || time.Now().After(deadline) {
				return a
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	same := func(a, b answer) bool {
		return a.class == answered && b.class == answered && a.code == b.code && bytes.Equal(a.body, b.body)
	}

	// lost reply, with the effect's visibility watched while it runs.
	k1 := newKey()
	watch := effect.watch(ctx, before, []string{k1})
	first := answerOf(k1)
	early := watch()
	retry := answerOf(k1)
	markers := retry.replay // the service marks replays (this library's marker)
	c := checkResult{Check: "lost reply", Sent: "key " + k1 + ", then the same again", Got: first.String() + ", then " + retry.String()}
	switch {
	case first.class != answered:
		c.Result, c.Why = "FAIL", "the first request got no answer of the service's ("+first.String()+"); the other checks need one"
	case !same(first, retry):
		c.Result, c.Why = "FAIL", "the retry did not get the first answer back byte for byte: the service ran the request again, or answered otherwise"
	case !retry.replay:
		c.Result, c.Why = "PASS", "the retry got the first answer, without this library's replay marker (Idempotency-Replayed, idempotency-replayed): "+
			"another server, or one that answers every request alike? -effect-sql tells"
	default:
		c.Result = "PASS"
	}
	results = append(results, c)
	if first.ok {
		executed++
	}

	// duplicates at once.
	k2 := newKey()
	answers := make([]answer, cfg.n)
	var wg sync.WaitGroup
	for i := range answers {
		wg.Go(func() { answers[i] = answerOf(k2) })
	}
	wg.Wait()
	c = checkResult{Check: "duplicates", Sent: fmt.Sprintf("%d requests with key %s at once", cfg.n, k2)}
	ran, marked, all := 0, 0, true
	for _, a := range answers {
		if a.class == answered && !a.replay {
			ran++
		}
		if a.replay {
			marked++
		}
		all = all && same(a, answers[0])
	}
	c.Got = fmt.Sprintf("%d answers, %d of them not marked as replays", len(answers), ran)
	switch {
	case !all:
		c.Result, c.Why = "FAIL", "the duplicates did not all get one answer: "+describeAnswers(answers)
	case marked == 0:
		c.Result, c.Why = "PASS", "one answer for all; no answer carried this library's replay marker, so how many ran is for the effect check (-effect-sql) to say"
	case ran > 1:
		c.Result, c.Why = "FAIL", fmt.Sprintf("%d of the duplicates were answered as executed, not as replays: the service ran more than once", ran)
	default:
		c.Result = "PASS"
	}
	results = append(results, c)
	if all && answers[0].ok {
		executed++
	}

	// a duplicate while the first runs.
	k3 := newKey()
	pair := make([]answer, 2)
	for i := range pair {
		wg.Go(func() { pair[i] = own(tg.send(ctx, k3, false, false)) })
	}
	wg.Wait()
	c = checkResult{Check: "in flight", Sent: "2 requests with key " + k3 + " at once, not sent again", Got: pair[0].String() + ", " + pair[1].String()}
	okPair := func(a, b answer) bool { return a.class == answered && (b.class == inProgress || same(a, b)) }
	if okPair(pair[0], pair[1]) || okPair(pair[1], pair[0]) {
		c.Result = "PASS"
		if pair[0].ok || pair[1].ok {
			executed++
		}
	} else {
		c.Result, c.Why = "FAIL", "a duplicate of a running request must be answered in progress (409, Aborted) or get the first's answer"
	}
	results = append(results, c)

	// the key with another request, which the service must serve under a
	// key of its own.
	other := tg.send(ctx, k1, true, false)
	c = checkResult{Check: "key reused", Sent: "key " + k1 + " with another request", Got: other.String()}
	switch {
	case other.class == keyReused:
		// Under a new key, sent alone, nothing is in progress; a refusal
		// there is the request's own, unless the service is this library
		// (it marked the lost reply's retry), whose key refusals say so.
		fresh := tg.send(ctx, newKey(), true, false)
		c.Got += "; under a new key, " + fresh.String()
		if fresh.class == answered || fresh.class == inProgress || (fresh.class == keyReused && markers && fresh.reason != "KEY_REUSED") {
			c.Result = "PASS"
			if fresh.ok {
				executed++
			}
		} else {
			c.Result, c.Why = "FAIL", "the other request is refused under a new key too, so the refusal says nothing of the key: give -other-body (-other-request) a request the service accepts"
		}
	case other.class == answered && same(other, first):
		c.Result, c.Why = "FAIL", "the key of another request must be refused (422, FailedPrecondition): the service gave the first answer to another request"
	default:
		c.Result, c.Why = "FAIL", "the key of another request must be refused (422, FailedPrecondition): the service answered otherwise"
		if other.ok && !other.replay {
			executed++
		}
	}
	results = append(results, c)

	// callers apart.
	c = checkResult{Check: "callers apart", Sent: "key " + k1 + " as a second caller"}
	if len(cfg.caller2) == 0 {
		c.Result, c.Got, c.Why = "SKIP", "-", "not checked: give -H2 with a second caller's headers (its Authorization, say)"
	} else {
		b := own(tg.send(ctx, k1, false, true))
		c.Sent, c.Got = "key "+k1+" as the second caller (-H2)", b.String()
		switch {
		case b.class == answered && (b.replay || (!markers && same(b, first))):
			c.Result, c.Why = "FAIL", "the second caller got the first caller's answer: the two share one scope of keys, so one caller's key replays another's result (scope keys per caller: WithScope, WithHTTPScope)"
		case b.class == answered:
			c.Result = "PASS"
			if b.ok {
				executed++
			}
		default:
			c.Result, c.Why = "FAIL", "the second caller got no answer of the service's"
		}
	}
	results = append(results, c)

	// no key.
	none := tg.send(ctx, "", false, false)
	c = checkResult{Check: "no key", Sent: "the request without a key", Got: none.String()}
	switch cfg.keyPolicy {
	case "required":
		if none.class == keyRefused {
			c.Result = "PASS"
		} else {
			c.Result, c.Why = "FAIL", "-key-policy required: a request without a key must be refused (400, InvalidArgument)"
		}
	case "optional":
		if own(none).class == answered {
			c.Result = "PASS"
		} else {
			c.Result, c.Why = "FAIL", "-key-policy optional: a request without a key must be served"
		}
	default:
		c.Result = "INFO"
	}
	if none.ok {
		executed++
	}
	results = append(results, c)

	c = checkResult{Check: "effect once", Sent: "-effect-sql before and after, and while the first request ran"}
	if effect == nil {
		c.Result, c.Got, c.Why = "SKIP", "-", "not checked: give -effect-sql, a query that counts the effect (and -database-url)"
	} else {
		after, _, err := effect.read(ctx, nil)
		switch {
		case err != nil:
			c.Result, c.Got, c.Why = "FAIL", "error", err.Error()
		case early:
			c.Result, c.Got = "FAIL", fmt.Sprintf("%d more (the checks executed %d operations)", after-before, executed)
			c.Why = "the effect became visible before its key's record: the handler writes outside the call's transaction (with the pool, or a connection of its own), so a call that fails after it keeps its effect and runs again"
		case after-before != int64(executed):
			c.Result, c.Got = "FAIL", fmt.Sprintf("%d more (the checks executed %d operations)", after-before, executed)
			c.Why = "the effect did not happen once per operation: the service ran a request twice, or its effect is not where -effect-sql counts it"
		default:
			c.Result, c.Got = "PASS", fmt.Sprintf("%d more, once per operation executed", after-before)
		}
	}
	results = append(results, c)
	return results
}

func describeAnswers(as []answer) string {
	counts := map[string]int{}
	var order []string
	for _, a := range as {
		s := a.String()
		if len(a.body) > 0 {
			s += fmt.Sprintf(" %q", truncate(a.body, 40))
		}
		if counts[s] == 0 {
			order = append(order, s)
		}
		counts[s]++
	}
	parts := make([]string, len(order))
	for i, s := range order {
		parts[i] = fmt.Sprintf("%d× %s", counts[s], s)
	}
	return strings.Join(parts, "; ")
}

func truncate(b []byte, n int) string {
	if len(b) > n {
		return string(b[:n]) + "..."
	}
	return string(b)
}

// effectProbe reads the effect's count, and whether keys have a record.
type effectProbe struct {
	pool    *pgxpool.Pool
	sql     string
	table   string
	timeout time.Duration
}

// read returns the effect's count, and whether any of keys (as stored by
// any transport) has a record, in one snapshot.
func (e *effectProbe) read(ctx context.Context, keys []string) (int64, bool, error) {
	var stored []string
	for _, k := range keys {
		stored = append(stored, k, "http "+k, "message "+k)
	}
	var n int64
	var recorded bool
	q := `SELECT (` + e.sql + `)::bigint, false`
	args := []any{}
	if len(keys) > 0 {
		q = `SELECT (` + e.sql + `)::bigint, EXISTS (SELECT FROM ` + e.table + ` WHERE key = ANY($1::text[]))`
		args = append(args, stored)
	}
	ctx, cancel := context.WithTimeout(ctx, e.timeout)
	defer cancel()
	err := e.pool.QueryRow(ctx, q, args...).Scan(&n, &recorded)
	return n, recorded, err
}

// watch polls, until the returned function is called, for the effect
// counted above before while keys have no record yet; the function reports
// whether it was ever seen. Without a probe it reports false.
func (e *effectProbe) watch(ctx context.Context, before int64, keys []string) func() bool {
	if e == nil {
		return func() bool { return false }
	}
	wctx, cancel := context.WithCancel(ctx)
	var seen bool
	done := make(chan struct{})
	go func() {
		defer close(done)
		for wctx.Err() == nil {
			n, recorded, err := e.read(wctx, keys)
			if err == nil && n > before && !recorded {
				seen = true
				return
			}
		}
	}()
	return func() bool {
		cancel()
		<-done
		return seen
	}
}
