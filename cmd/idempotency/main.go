// Command idempotency manages the key table of an idempotency store: it
// applies or prints the migrations, and looks at, lists, forgets and cleans
// up keys.
//
//	idempotency [flags] migrate              apply the migrations (Store.Migrate)
//	idempotency [flags] sql [-down] [-format plain|golang-migrate|goose] [-dir DIR]
//	                                         print the migrations, or write them as files
//	idempotency [flags] inspect SCOPE KEY    print one key's record as JSON
//	idempotency [flags] list [-scope S] [-method M] [-state S] [-newer-than D] [-older-than D]
//	                         [-limit N] [-examine N] [-after NEXT]
//	                                         print the records that match, as JSON (Store.List)
//	idempotency [flags] forget SCOPE KEY     delete one key's record (refused while in progress)
//	idempotency [flags] cleanup [-batch N]   delete every expired key now, paced as the cleaner
//	idempotency [flags] verify [-http URL | -grpc ADDR -method M] ...
//	                                         check a running service against the promise (verify -h)
//
// Flags: -database-url (default $DATABASE_URL, else the local test
// database postgres://postgres:postgres@127.0.0.1:5432/test, like every
// program of this repository; a URL or a keyword/value string), -schema
// and -table (the store's WithTable; default the connection's search_path
// and "idempotency_keys"), and -proto-descriptors FILE (repeatable): a
// descriptor set of your protos, made with buf build -o FILE or protoc
// --include_imports --descriptor_set_out=FILE, with which inspect and list
// print stored responses of your own types as JSON. No secret of the
// connection string (password, sslpassword, passfile, ...) is ever
// printed, in help or in errors.
//
// The module is not published yet: run it from a clone, with
// go run ./cmd/idempotency at the repository's root.
package main

import (
	"context"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	statuspb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/dburl"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	os.Exit(run(ctx, os.Args[1:], os.Stdout, os.Stderr))
}

const usage = `usage: idempotency [flags] <command> [arguments]

commands:
  migrate              apply the migrations of the key table
  sql                  print the up migrations (-down: the down ones), or write
                       them as files for a migration tool (-format, -dir)
  inspect SCOPE KEY    print the record of one key as JSON
  list                 print the records of a scope, a method, a state or an age
                       as JSON (idempotency list -h for its filters)
  forget SCOPE KEY     delete the record of one key, so that it runs again
  cleanup              delete every expired key now, in batches paced as the
                       library's cleaner paces them (-batch N: their size)
  verify               check that a running service keeps the promise: lost
                       replies, duplicates, a key reused, no key, and with
                       -effect-sql the effect once (idempotency verify -h)

flags:
`

// scopesNamed is how many other scopes inspect names when a key has no
// record in the one asked for; scopesWait, how long it looks.
const (
	scopesNamed = 5
	scopesWait  = 5 * time.Second
)

// run is the command, with its exit status: 0, 1 on failure, 2 on misuse.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("idempotency", flag.ContinueOnError)
	fs.SetOutput(stderr)
	dbURL := fs.String("database-url", "", dburl.Usage())
	schema := fs.String("schema", "", "schema of the key table (default: the connection's search_path)")
	table := fs.String("table", idempotency.DefaultTable, "name of the key table")
	var descriptorFiles []string
	fs.Func("proto-descriptors", "a descriptor set of your protos ("+descriptorsHelp+"), to print stored responses of your types as JSON; repeatable",
		func(path string) error { descriptorFiles = append(descriptorFiles, path); return nil })
	fs.Usage = func() {
		fmt.Fprint(stderr, usage)
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fs.NArg() == 0 {
		fs.Usage()
		return 2
	}
	cmd, rest := fs.Arg(0), fs.Args()[1:]
	if *dbURL == "" {
		*dbURL = dburl.URL()
	}
	fail := func(err error) int {
		fmt.Fprintf(stderr, "idempotency %s: %s\n", cmd, dburl.Scrub(message(cmd, err), *dbURL))
		if pgErr := (*pgconn.PgError)(nil); errors.As(err, &pgErr) && pgErr.Code == "42P01" {
			fmt.Fprintln(stderr, "idempotency migrate, with the same -database-url, -schema and -table, creates the table")
		}
		return 1
	}
	misuse := func(format string, a ...any) int {
		fmt.Fprintf(stderr, "idempotency %s: %s\n", cmd, fmt.Sprintf(format, a...))
		return 2
	}

	if cmd == "sql" { // needs no database
		return sqlCommand(rest, *schema, *table, stdout, stderr)
	}
	if cmd == "verify" { // a database only for -effect-sql
		return verifyCommand(ctx, rest, verifyConfig{descriptorFiles: descriptorFiles, dbURL: *dbURL, schema: *schema, table: *table}, stdout, stderr)
	}
	var list idempotency.ListFilter
	batch := 10000
	switch cmd {
	case "migrate":
		if len(rest) != 0 {
			return misuse("takes no arguments")
		}
	case "cleanup":
		cfs := flag.NewFlagSet("idempotency cleanup", flag.ContinueOnError)
		cfs.SetOutput(stderr)
		cfs.IntVar(&batch, "batch", batch, "keys deleted per batch; between two full batches the command pauses nine times as long as the last took, as the library's cleaner does")
		if err := cfs.Parse(rest); err != nil {
			return 2
		}
		if cfs.NArg() != 0 || batch <= 0 {
			return misuse("takes only -batch N, a positive number")
		}
	case "inspect", "forget":
		if len(rest) != 2 {
			return misuse("needs SCOPE and KEY (an empty scope is \"\")")
		}
	case "list":
		var code int
		if list, code = listFlags(rest, stderr); code != 0 {
			return max(code, 0) // -1: help was asked for
		}
	default:
		return misuse("unknown command; run idempotency -h")
	}
	types, err := loadProtoTypes(descriptorFiles)
	if err != nil {
		return misuse("%v", err)
	}
	// pgx's errors about a malformed string quote it: it is checked first.
	if err := dburl.Check(*dbURL); err != nil {
		return fail(err)
	}
	pool, err := pgxpool.New(ctx, *dbURL)
	if err != nil {
		return fail(err)
	}
	defer pool.Close()
	progress := &cleanupProgress{w: stderr}
	store, err := idempotency.NewStore(pool, idempotency.WithTable(*schema, *table), idempotency.WithTracer(progress))
	if err != nil {
		return fail(err)
	}

	switch cmd {
	case "migrate":
		if err := store.Migrate(ctx); err != nil {
			return fail(err)
		}
		fmt.Fprintln(stdout, "migrations applied")
	case "cleanup":
		n, err := store.DeleteExpired(ctx, batch)
		if err != nil {
			fmt.Fprintf(stdout, "deleted %d expired keys before the error\n", n)
			return fail(err)
		}
		fmt.Fprintf(stdout, "deleted %d expired keys\n", n)
	case "inspect":
		rec, err := store.Inspect(ctx, rest[0], rest[1])
		if err != nil {
			return fail(elsewhere(ctx, store, rest[0], rest[1], err))
		}
		if err := printJSON(stdout, recordJSON(rec, types)); err != nil {
			return fail(err)
		}
	case "list":
		page, err := store.List(ctx, list)
		if err != nil {
			return fail(err)
		}
		out := listJSON{Keys: []inspected{}, Examined: page.Examined, Next: page.Next}
		for _, rec := range page.Records {
			out.Keys = append(out.Keys, recordJSON(rec, types))
		}
		if err := printJSON(stdout, out); err != nil {
			return fail(err)
		}
		if page.Next != "" {
			fmt.Fprintf(stderr, "idempotency list: %d keys listed of %d examined; more may follow: run it again with -after %s\n",
				len(page.Records), page.Examined, page.Next)
		}
	case "forget":
		if err := store.Forget(ctx, rest[0], rest[1], ""); err != nil {
			return fail(elsewhere(ctx, store, rest[0], rest[1], err))
		}
		fmt.Fprintf(stdout, "forgot key %q of scope %q\n", rest[1], rest[0])
	}
	return 0
}

// listFlags parses list's flags into a filter, or returns the exit status
// of a misuse, or -1 after printing the help asked for.
func listFlags(args []string, stderr io.Writer) (idempotency.ListFilter, int) {
	var f idempotency.ListFilter
	fs := flag.NewFlagSet("idempotency list", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&f.Scope, "scope", "", "list this scope's keys (-scope \"\" is the empty scope; without -scope, every scope's)")
	fs.StringVar(&f.Method, "method", "", "only this method's keys: /pkg.Service/Method, \"POST /path\", idempotency/message; a trailing * matches a prefix")
	fs.StringVar(&f.State, "state", "", "only keys in this state: succeeded, failed or running")
	fs.DurationVar(&f.NewerThan, "newer-than", 0, "only keys created less than this long ago (e.g. 30m, 48h)")
	fs.DurationVar(&f.OlderThan, "older-than", 0, "only keys created more than this long ago")
	fs.IntVar(&f.Limit, "limit", 100, "at most this many keys (up to 10000)")
	fs.IntVar(&f.Examine, "examine", 10000, "look at most at this many keys, matching or not, so that a filter few keys match never reads much of the table at once (-after the output's \"next\" goes on)")
	fs.StringVar(&f.After, "after", "", "go on after the page whose \"next\" this is")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return f, -1
		}
		return f, 2
	}
	if fs.NArg() != 0 {
		fmt.Fprintln(stderr, "idempotency list: takes only flags; run idempotency list -h")
		return f, 2
	}
	f.AnyScope = true
	fs.Visit(func(fl *flag.Flag) {
		if fl.Name == "scope" {
			f.AnyScope = false
		}
	})
	return f, 0
}

// elsewhere adds to a key's ErrKeyNotFound the scopes that do hold it:
// the usual mistake is the scope (the empty one for a tenant's key, say).
func elsewhere(ctx context.Context, store *idempotency.Store, scope, key string, err error) error {
	if !errors.Is(err, idempotency.ErrKeyNotFound) {
		return err
	}
	lookCtx, cancel := context.WithTimeout(ctx, scopesWait)
	defer cancel()
	// Every scope, until the wait ends: a key has a record per transport
	// at most in each.
	page, lookErr := store.List(lookCtx, idempotency.ListFilter{AnyScope: true, Key: key, Limit: 3 * (scopesNamed + 2), Examine: math.MaxInt32})
	var others []string
	for _, rec := range page.Records {
		if q := strconv.Quote(rec.Scope); rec.Scope != scope && !slices.Contains(others, q) {
			others = append(others, q)
		}
	}
	switch {
	case lookErr != nil && ctx.Err() != nil:
		return err
	case lookErr != nil:
		return fmt.Errorf("%w in scope %q; the other scopes were not all looked through in %v (%s)", err, scope, scopesWait,
			strings.TrimPrefix(lookErr.Error(), "idempotency: "))
	case len(others) == 0:
		return fmt.Errorf("%w in scope %q, nor in any other scope", err, scope)
	case len(others) > scopesNamed:
		return fmt.Errorf("%w in scope %q; the key has records in scopes %s and more: did you mean one of them?", err, scope, strings.Join(others[:scopesNamed], ", "))
	default:
		return fmt.Errorf("%w in scope %q; the key has records in scope %s: did you mean it?", err, scope, strings.Join(others, ", "))
	}
}

// cleanupProgress is the command's tracer: it prints each batch of a
// cleanup, and the pause after it, to stderr.
type cleanupProgress struct {
	w       io.Writer
	batches int
}

func (p *cleanupProgress) TraceCallStart(ctx context.Context, _ idempotency.TraceCallStartData) context.Context {
	return ctx
}

func (p *cleanupProgress) TraceCallEnd(context.Context, idempotency.TraceCallEndData) {}

func (p *cleanupProgress) TraceCleanerBatch(_ context.Context, data idempotency.TraceCleanerBatchData) {
	p.batches++
	if data.Err != nil {
		return // the command prints it
	}
	line := fmt.Sprintf("batch %d: deleted %d expired keys in %v", p.batches, data.Deleted, data.Duration.Round(time.Millisecond))
	if data.Pause > 0 {
		line += fmt.Sprintf("; pausing %v (nine times the batch, as the cleaner does)", data.Pause.Round(time.Millisecond))
	}
	fmt.Fprintln(p.w, line)
}

// printJSON prints v as indented JSON.
func printJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// listJSON is the JSON form of a page of list.
type listJSON struct {
	Keys     []inspected `json:"keys"`
	Examined int         `json:"examined"`
	// Next, for -after, when more may follow.
	Next string `json:"next,omitempty"`
}

// inspected is the JSON form of a record.
type inspected struct {
	Scope        string          `json:"scope"`
	Key          string          `json:"key"`
	Transport    string          `json:"transport"`
	Method       string          `json:"method"`
	State        string          `json:"state"`
	CreatedAt    time.Time       `json:"created_at"`
	CompletedAt  *time.Time      `json:"completed_at,omitempty"`
	ExpiresAt    time.Time       `json:"expires_at"`
	Expired      bool            `json:"expired"`
	ResponseType string          `json:"response_type,omitempty"`
	Response     json.RawMessage `json:"response,omitempty"`
	ResponseHex  string          `json:"response_hex,omitempty"`
	// Hint says why the response is in hex, and how to have it decoded.
	Hint   string          `json:"hint,omitempty"`
	Status json.RawMessage `json:"status,omitempty"`
	HTTP   *httpJSON       `json:"http,omitempty"`
	// Fingerprint identifies the request the key was first used with.
	Fingerprint string `json:"fingerprint"`
	// Steps are the records of the steps the key's call ran (see
	// idempotency.Step).
	Steps []inspected `json:"steps,omitempty"`
}

// httpJSON is the response an HTTP request's record replays.
type httpJSON struct {
	Status int `json:"status"`
	// Header holds the headers a replay sends.
	Header http.Header `json:"header,omitempty"`
	// Trailer holds the trailers a replay sends.
	Trailer http.Header `json:"trailer,omitempty"`
	// Body is the body as text when it is UTF-8, BodyBase64 otherwise.
	Body       *string `json:"body,omitempty"`
	BodyBase64 string  `json:"body_base64,omitempty"`
}

// recordJSON renders a record: an HTTP response as its status, the
// headers a replay sends, and its body; another response as JSON when
// types knows its type, else as hex with a hint.
func recordJSON(rec idempotency.Record, types protoTypes) inspected {
	out := inspected{
		Scope: rec.Scope, Key: rec.Key, Transport: string(rec.Transport), Method: rec.Method, State: rec.State,
		CreatedAt: rec.CreatedAt, ExpiresAt: rec.ExpiresAt, Expired: rec.Expired,
		ResponseType: rec.ResponseType, Fingerprint: hex.EncodeToString(rec.Fingerprint),
	}
	if !rec.CompletedAt.IsZero() {
		out.CompletedAt = &rec.CompletedAt
	}
	if resp := rec.HTTPResponse(); resp != nil {
		body, _ := io.ReadAll(resp.Body) // a bytes.Reader's: never fails
		out.ResponseType = ""
		out.HTTP = &httpJSON{Status: resp.StatusCode, Header: resp.Header, Trailer: resp.Trailer}
		if utf8.Valid(body) {
			text := string(body)
			out.HTTP.Body = &text
		} else {
			out.HTTP.BodyBase64 = base64.StdEncoding.EncodeToString(body)
		}
	} else if rec.ResponseType != "" {
		out.ResponseHex = hex.EncodeToString(rec.Response)
		mt, err := types.FindMessageByName(protoreflect.FullName(rec.ResponseType))
		if err != nil {
			out.Hint = unknownTypeHint(rec.ResponseType)
		} else {
			m := mt.New().Interface()
			err := proto.UnmarshalOptions{Resolver: types}.Unmarshal(rec.Response, m)
			if err == nil {
				var b []byte
				if b, err = (protojson.MarshalOptions{Resolver: types}).Marshal(m); err == nil {
					out.Response, out.ResponseHex = b, ""
				}
			}
			if err != nil {
				out.Hint = fmt.Sprintf("the response does not decode as %s: %v", rec.ResponseType, err)
			}
		}
	}
	if rec.Status != nil {
		out.Status = statusJSON(rec.Status.Proto(), types)
	}
	for _, step := range rec.Steps {
		out.Steps = append(out.Steps, recordJSON(step, types))
	}
	return out
}

// statusJSON renders a stored error, its details decoded with types; a
// detail of a type types does not know is shown by its type URL and bytes.
func statusJSON(st *statuspb.Status, types protoTypes) json.RawMessage {
	if b, err := (protojson.MarshalOptions{Resolver: types}).Marshal(st); err == nil {
		return b
	}
	type unknownDetail struct {
		Type string `json:"@type"`
		Hex  string `json:"value_hex"`
		Hint string `json:"hint"`
	}
	out := struct {
		Code    int32  `json:"code,omitempty"`
		Message string `json:"message,omitempty"`
		Details []any  `json:"details,omitempty"`
	}{Code: st.GetCode(), Message: st.GetMessage()}
	for _, d := range st.GetDetails() {
		if b, err := (protojson.MarshalOptions{Resolver: types}).Marshal(d); err == nil {
			out.Details = append(out.Details, json.RawMessage(b))
			continue
		}
		name := d.GetTypeUrl()[strings.LastIndex(d.GetTypeUrl(), "/")+1:]
		out.Details = append(out.Details, unknownDetail{Type: d.GetTypeUrl(), Hex: hex.EncodeToString(d.GetValue()), Hint: unknownTypeHint(name)})
	}
	b, _ := json.Marshal(out)
	return b
}

// sqlCommand prints the migrations, or writes them as files in the layout
// a migration tool reads.
func sqlCommand(args []string, schema, table string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("idempotency sql", flag.ContinueOnError)
	fs.SetOutput(stderr)
	down := fs.Bool("down", false, "print the down migrations, newest first, instead of the up ones (-format plain only: the files of the other formats hold both directions)")
	format := fs.String("format", "plain", "plain (print), golang-migrate (NNN_name.up.sql and .down.sql; also Atlas's golang-migrate format) or goose (NNN_name.sql with +goose annotations)")
	dir := fs.String("dir", "", "write the files into this directory instead of printing (golang-migrate and goose formats)")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if *down && *format != "plain" {
		fmt.Fprintf(stderr, "idempotency sql: -down applies to -format plain only; -format %s writes both directions in its files\n", *format)
		return 2
	}
	ms, err := idempotency.Migrations(schema, table)
	if err != nil {
		fmt.Fprintln(stderr, "idempotency sql:", message("sql", err))
		return 2
	}
	files := map[string]string{}
	var order []string
	add := func(name, text string) {
		files[name] = text
		order = append(order, name)
	}
	switch *format {
	case "plain":
		if *dir != "" {
			fmt.Fprintln(stderr, "idempotency sql: -dir needs -format golang-migrate or goose")
			return 2
		}
		if *down {
			for i := len(ms) - 1; i >= 0; i-- {
				fmt.Fprintf(stdout, "-- %s (down)\n%s\n\n", ms[i].Name, strings.TrimSpace(ms[i].Down))
			}
		} else {
			for _, m := range ms {
				fmt.Fprintf(stdout, "-- %s\n%s\n\n", m.Name, strings.TrimSpace(m.SQL))
			}
		}
		return 0
	case "golang-migrate":
		for _, m := range ms {
			add(m.Name+".up.sql", m.SQL)
			add(m.Name+".down.sql", m.Down)
		}
	case "goose":
		for _, m := range ms {
			add(m.Name+".sql", "-- +goose Up\n-- +goose StatementBegin\n"+strings.TrimSpace(m.SQL)+"\n-- +goose StatementEnd\n\n-- +goose Down\n-- +goose StatementBegin\n"+strings.TrimSpace(m.Down)+"\n-- +goose StatementEnd\n")
		}
	default:
		fmt.Fprintf(stderr, "idempotency sql: unknown -format %q\n", *format)
		return 2
	}
	for _, name := range order {
		if *dir == "" {
			fmt.Fprintf(stdout, "-- file %s\n%s\n", name, files[name])
			continue
		}
		if err := os.MkdirAll(*dir, 0o755); err != nil {
			fmt.Fprintln(stderr, "idempotency sql:", err)
			return 1
		}
		if err := os.WriteFile(filepath.Join(*dir, name), []byte(files[name]), 0o644); err != nil {
			fmt.Fprintln(stderr, "idempotency sql:", err)
			return 1
		}
		fmt.Fprintln(stdout, filepath.Join(*dir, name))
	}
	return 0
}

// message is err's text without the prefixes the command's own already
// says: "idempotency: " and the command's name.
func message(cmd string, err error) string {
	m := strings.TrimPrefix(err.Error(), "idempotency: ")
	for _, p := range []string{cmd + " key: ", cmd + ": "} {
		m = strings.TrimPrefix(m, p)
	}
	return m
}
