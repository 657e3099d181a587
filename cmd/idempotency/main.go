// Command idempotency manages the key table of an idempotency store: it
// applies or prints the migrations, and looks at, forgets and cleans up
// keys.
//
//	idempotency [flags] migrate              apply the migrations (Store.Migrate)
//	idempotency [flags] sql [-down] [-format plain|golang-migrate|goose] [-dir DIR]
//	                                         print the migrations, or write them as files
//	idempotency [flags] inspect SCOPE KEY    print one key's record as JSON
//	idempotency [flags] forget SCOPE KEY     delete one key's record (refused while in progress)
//	idempotency [flags] cleanup              delete every expired key now
//
// Flags: -database-url (default $DATABASE_URL, else the local test
// database postgres://postgres:postgres@127.0.0.1:5432/test, like every
// program of this repository), -schema and -table (the store's WithTable;
// default the connection's search_path and "idempotency_keys"). The
// password of the database URL is never printed.
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
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"

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
  forget SCOPE KEY     delete the record of one key, so that it runs again
  cleanup              delete every expired key now

flags:
`

// run is the command, with its exit status: 0, 1 on failure, 2 on misuse.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("idempotency", flag.ContinueOnError)
	fs.SetOutput(stderr)
	dbURL := fs.String("database-url", "", dburl.Usage())
	schema := fs.String("schema", "", "schema of the key table (default: the connection's search_path)")
	table := fs.String("table", idempotency.DefaultTable, "name of the key table")
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
	switch cmd {
	case "migrate", "cleanup":
		if len(rest) != 0 {
			return misuse("takes no arguments")
		}
	case "inspect", "forget":
		if len(rest) != 2 {
			return misuse("needs SCOPE and KEY (an empty scope is \"\")")
		}
	default:
		return misuse("unknown command; run idempotency -h")
	}
	pool, err := pgxpool.New(ctx, *dbURL)
	if err != nil {
		return fail(err)
	}
	defer pool.Close()
	store, err := idempotency.NewStore(pool, idempotency.WithTable(*schema, *table))
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
		var total int64
		for {
			n, err := store.DeleteExpired(ctx, 10000)
			total += n
			if err != nil {
				return fail(err)
			}
			if n < 10000 {
				break
			}
		}
		fmt.Fprintf(stdout, "deleted %d expired keys\n", total)
	case "inspect":
		rec, err := store.Inspect(ctx, rest[0], rest[1])
		if err != nil {
			return fail(err)
		}
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(recordJSON(rec)); err != nil {
			return fail(err)
		}
	case "forget":
		if err := store.Forget(ctx, rest[0], rest[1]); err != nil {
			return fail(err)
		}
		fmt.Fprintf(stdout, "forgot key %q of scope %q\n", rest[1], rest[0])
	}
	return 0
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
	Status       json.RawMessage `json:"status,omitempty"`
	HTTP         *httpJSON       `json:"http,omitempty"`
	Fingerprint  string          `json:"fingerprint"`
}

// httpJSON is the response an HTTP request's record replays.
type httpJSON struct {
	Status int         `json:"status"`
	Header http.Header `json:"header,omitempty"`
	// Trailer holds the trailers a replay carries.
	Trailer http.Header `json:"trailer,omitempty"`
	// Body is the body as text when it is UTF-8, BodyBase64 otherwise.
	Body       *string `json:"body,omitempty"`
	BodyBase64 string  `json:"body_base64,omitempty"`
}

// recordJSON renders a record: an HTTP response as its status, headers
// and body; another response as JSON when its type is linked into this
// command, else as hex.
func recordJSON(rec idempotency.Record) inspected {
	out := inspected{
		Scope: rec.Scope, Key: rec.Key, Transport: string(rec.Transport), Method: rec.Method, State: rec.State,
		CreatedAt: rec.CreatedAt, ExpiresAt: rec.ExpiresAt, Expired: rec.Expired,
		ResponseType: rec.ResponseType, Fingerprint: hex.EncodeToString(rec.Fingerprint),
	}
	if !rec.CompletedAt.IsZero() {
		out.CompletedAt = &rec.CompletedAt
	}
	if code, header, body, ok := rec.HTTPResponse(); ok {
		out.ResponseType = ""
		out.HTTP = &httpJSON{Status: code, Header: header, Trailer: rec.HTTPTrailer()}
		if utf8.Valid(body) {
			text := string(body)
			out.HTTP.Body = &text
		} else {
			out.HTTP.BodyBase64 = base64.StdEncoding.EncodeToString(body)
		}
	} else if rec.ResponseType != "" {
		out.ResponseHex = hex.EncodeToString(rec.Response)
		if mt, err := protoregistry.GlobalTypes.FindMessageByName(protoreflect.FullName(rec.ResponseType)); err == nil {
			m := mt.New().Interface()
			if err := proto.Unmarshal(rec.Response, m); err == nil {
				if b, err := protojson.Marshal(m); err == nil {
					out.Response, out.ResponseHex = b, ""
				}
			}
		}
	}
	if rec.Status != nil {
		if b, err := protojson.Marshal(rec.Status.Proto()); err == nil {
			out.Status = b
		}
	}
	return out
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
	ms, err := idempotency.MigrationsFor(schema, table)
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
