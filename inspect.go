package idempotency

import (
	"bytes"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	statuspb "google.golang.org/genproto/googleapis/rpc/status"
	grpcstatus "google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// ErrKeyNotFound is returned by [Store.Inspect] and [Store.Forget] for a key
// that has no record (never used, released, or deleted by the cleaner).
var ErrKeyNotFound = errors.New("idempotency: no record of this key")

// Record is what a store keeps of one key, for operators: [Store.Inspect].
type Record struct {
	Scope, Key string
	// Transport is the kind of call the key belongs to: TransportHTTP,
	// TransportMessage, or TransportGRPC for gRPC calls and Store.Execute,
	// which share one namespace of keys.
	Transport Transport
	// Method is the operation the key was used for: the gRPC full method,
	// "POST /path" for HTTP, "idempotency/message" for a message.
	Method string
	// State is "succeeded" (Response holds the result) or "failed" (Status
	// holds the final error); "running" is a claim its handler committed
	// (it ended the call's transaction itself), which the next call with
	// the key stores as failed.
	State string
	// CreatedAt is when the key was claimed, CompletedAt when its result
	// was stored (zero for a claim, and for keys stored by earlier versions
	// of this module, whose CreatedAt is that moment), ExpiresAt when the
	// key expires; Expired says whether it already has (the cleaner has not
	// deleted it yet).
	CreatedAt, CompletedAt, ExpiresAt time.Time
	Expired                           bool
	// ResponseType is the stored response's protobuf message name, "" when
	// there is none; Response its encoding. An HTTP response is a
	// google.protobuf.BytesValue holding the body.
	ResponseType string
	Response     []byte
	// Status is the final error of a failed call.
	Status *grpcstatus.Status
	// Fingerprint identifies the request the key was first used with.
	Fingerprint []byte
	// Metadata is what the transport stored with the result (a gRPC call's
	// headers and trailers, an HTTP response's status, headers and
	// trailers), in its
	// own encoding.
	Metadata []byte
	// Steps are the records of the steps (see Step) the key's call ran, in
	// the order they were recorded, from every run of the call: each with
	// the step's name as Method and its key, "step " and the key the
	// step sent, as Key.
	Steps []Record
}

// HTTPResponse returns the response an HTTP request's record holds, as a
// replay of it sends it: its status, body, and the headers and trailers a
// replay can send. Set-Cookie, Authorization and the other headers no
// replay ever sends are left out, though the middleware's first version
// stored them; of the others a record of that version holds (Date, say),
// a replay sends only those its middleware's WithHTTPReplayedHeaders
// allows. It is nil for a record of another transport, or one without a
// response (an error the engine stored, such as a handler that ended the
// transaction; Status has it).
func (r Record) HTTPResponse() *http.Response {
	rr := r.httpResponse()
	if rr == nil {
		return nil
	}
	code := rr.statusCode()
	return &http.Response{
		Status:        strconv.Itoa(code) + " " + http.StatusText(code),
		StatusCode:    code,
		Proto:         "HTTP/1.1",
		ProtoMajor:    1,
		ProtoMinor:    1,
		Header:        rr.sent,
		Trailer:       rr.trailer,
		Body:          io.NopCloser(bytes.NewReader(rr.body.Bytes())),
		ContentLength: int64(rr.body.Len()),
	}
}

// httpResponse decodes the HTTP response the record holds, nil for none,
// without the headers and trailers no replay sends.
func (r Record) httpResponse() *responseRecorder {
	if r.Transport != TransportHTTP || r.ResponseType != string(httpBodyType.Descriptor().FullName()) {
		return nil
	}
	m := &wrapperspb.BytesValue{}
	if err := proto.Unmarshal(r.Response, m); err != nil {
		return nil
	}
	rr, err := decodeHTTPResponse(result{Result: Result{Response: m}, metadata: r.Metadata})
	if err != nil {
		return nil
	}
	for _, h := range []http.Header{rr.sent, rr.trailer} {
		maps.DeleteFunc(h, func(name string, _ []string) bool { return !replayable(name) })
	}
	return rr
}

// namespaces are the transports' namespaces of stored keys, in the order
// Inspect and Forget look in them.
var namespaces = []struct {
	prefix    string
	transport Transport
}{{"", TransportGRPC}, {namespaceHTTP, TransportHTTP}, {namespaceMessage, TransportMessage}}

// storedKeys returns the stored keys key may name: key as each transport
// stores it, in the order of namespaces; or key alone when it is one
// already ("http KEY", "message KEY": no client's key has a space).
func storedKeys(key string) []string {
	if strings.HasPrefix(key, namespaceStep) {
		return []string{key}
	}
	for _, ns := range namespaces[1:] {
		if strings.HasPrefix(key, ns.prefix) {
			return []string{key}
		}
	}
	keys := make([]string, len(namespaces))
	for i, ns := range namespaces {
		keys[i] = ns.prefix + key
	}
	return keys
}

// transportOf splits a stored key into its transport and the key.
func transportOf(stored string) (Transport, string) {
	if strings.HasPrefix(stored, namespaceStep) {
		return TransportStep, stored
	}
	for _, ns := range namespaces[1:] {
		if key, ok := strings.CutPrefix(stored, ns.prefix); ok {
			return ns.transport, key
		}
	}
	return TransportGRPC, stored
}

// Inspect returns the record of one key. Keys of different transports
// never collide in the table; a key used by more than one (an HTTP
// request's and a gRPC call's, say) is looked for among gRPC calls and
// Execute's first, then HTTP requests, then messages. To name one
// transport's, prefix the key with its namespace: "http KEY" or
// "message KEY". A key whose call is still running has no record yet:
// Inspect then returns [ErrInProgress]; one with no record and no call,
// [ErrKeyNotFound].
func (s *Store) Inspect(ctx context.Context, scope, key string) (Record, error) {
	st, err := s.statements(ctx)
	if err != nil {
		return Record{Scope: scope, Key: key}, s.dbError(ctx, "inspect key", err)
	}
	keys := storedKeys(key)
	var raw rawRecord
	var steps []rawRecord
	err = s.readCommitted(ctx, func(tx pgx.Tx) error {
		err := tx.QueryRow(ctx, st.inspect, scope, keys).Scan(raw.targets()...)
		if err == nil && raw.stored != nil && !strings.HasPrefix(*raw.stored, namespaceStep) {
			steps, err = readSteps(ctx, tx, st, scope, *raw.stored)
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			return err
		}
		var free bool
		if err := tx.QueryRow(ctx, st.lockForget, scope, keys).Scan(&free); err != nil {
			return err
		}
		if !free {
			return inProgress("the key's call is still running; nothing is stored for it yet", s.opts.retryDelay)
		}
		return ErrKeyNotFound
	})
	if errors.Is(err, ErrKeyNotFound) || errors.Is(err, ErrInProgress) {
		return Record{Scope: scope, Key: key}, err
	}
	if err != nil {
		return Record{Scope: scope, Key: key}, s.dbError(ctx, "inspect key", err)
	}
	rec, err := raw.record(scope)
	if err != nil {
		return rec, fmt.Errorf("idempotency: inspect key: %w", err)
	}
	for _, r := range steps {
		step, err := r.record(scope)
		if err != nil {
			return rec, fmt.Errorf("idempotency: inspect key: step: %w", err)
		}
		rec.Steps = append(rec.Steps, step)
	}
	return rec, nil
}

// readSteps reads the records of the steps of the call whose stored key is
// parent (see Step): they are found among the scope's records, by the
// parent's key they hold, so on a scope of millions of keys it takes a
// while (Inspect is an operator's tool; calls never read them this way).
func readSteps(ctx context.Context, tx pgx.Tx, st *statements, scope, parent string) ([]rawRecord, error) {
	rows, err := tx.Query(ctx, st.inspectSteps, scope, []byte(parent))
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var steps []rawRecord
	for rows.Next() {
		var r rawRecord
		if err := rows.Scan(r.targets()...); err != nil {
			return nil, err
		}
		steps = append(steps, r)
	}
	return steps, rows.Err()
}

// rawRecord is a record as the statements that read one return it (see
// statements.inspect): times in microseconds since the epoch, bytes in
// base64, so that no session setting changes how they read. Every column
// may be NULL, for the rows List reads and does not keep.
type rawRecord struct {
	stored, method, state                                 *string
	created, completed, expires                           *int64
	expired                                               *bool
	responseType, response, status, fingerprint, metadata *string
}

// recordColumns are the columns of a rawRecord, of the table aliased w, as
// statements.inspect reads them.
var recordColumns = []string{"w.key", "w.method", "w.state", "(extract(epoch FROM w.created_at) * 1000000)::bigint",
	"(extract(epoch FROM w.completed_at) * 1000000)::bigint", "(extract(epoch FROM w.expires_at) * 1000000)::bigint",
	"w.expires_at <= pg_catalog.now()", "w.response_type", "pg_catalog.encode(w.response, 'base64')", "pg_catalog.encode(w.status, 'base64')",
	"pg_catalog.encode(w.fingerprint, 'base64')", "pg_catalog.encode(w.metadata, 'base64')"}

// targets are the Scan destinations of recordColumns.
func (r *rawRecord) targets() []any {
	return []any{&r.stored, &r.method, &r.state, &r.created, &r.completed, &r.expires, &r.expired,
		&r.responseType, &r.response, &r.status, &r.fingerprint, &r.metadata}
}

// record decodes the record of a key of scope.
func (r *rawRecord) record(scope string) (Record, error) {
	deref := func(p *string) string {
		if p == nil {
			return ""
		}
		return *p
	}
	micros := func(p *int64) time.Time {
		if p == nil {
			return time.Time{}
		}
		return time.UnixMicro(*p)
	}
	rec := Record{Scope: scope, Method: deref(r.method), State: deref(r.state), Expired: r.expired != nil && *r.expired,
		CreatedAt: micros(r.created), CompletedAt: micros(r.completed), ExpiresAt: micros(r.expires), ResponseType: deref(r.responseType)}
	rec.Transport, rec.Key = transportOf(deref(r.stored))
	var statusBytes []byte
	for _, c := range []struct {
		dst *[]byte
		src *string
	}{{&rec.Response, r.response}, {&statusBytes, r.status}, {&rec.Fingerprint, r.fingerprint}, {&rec.Metadata, r.metadata}} {
		var err error
		if *c.dst, err = decodeBase64(c.src); err != nil {
			return rec, err
		}
	}
	if statusBytes != nil {
		p := &statuspb.Status{}
		if err := proto.Unmarshal(statusBytes, p); err != nil {
			return rec, fmt.Errorf("stored status: %w", err)
		}
		rec.Status = grpcstatus.FromProto(p)
	}
	return rec, nil
}

// ListFilter chooses the records [Store.List] returns.
type ListFilter struct {
	// Scope is the scope whose records are listed ("" is the empty scope,
	// as for Inspect), unless AnyScope is set.
	Scope string
	// AnyScope lists the records of every scope. Defaults to false.
	AnyScope bool
	// Method keeps the records of one method (the gRPC full method,
	// "POST /path" for HTTP, "idempotency/message" for messages); a
	// trailing '*' keeps those whose method begins with what comes before
	// it ("/pay.v1.Payments/*"). Defaults to "", every method.
	Method string
	// State keeps the records in one state: "succeeded", "failed" or
	// "running" (see Record.State). Defaults to "", every state.
	State string
	// NewerThan keeps the records created less than this long ago,
	// OlderThan those created more than this long ago, by the database's
	// clock. Zero, the default, bounds nothing.
	NewerThan, OlderThan time.Duration
	// Key keeps the records of one key, named as for Inspect: with a
	// transport's namespace before it ("http KEY", "message KEY") the
	// record of that transport's, without one those of every transport's.
	// With AnyScope it is found in every scope that holds it, where an
	// operator who found no record of a key in one scope should look: the
	// table's primary key leads with the scope, so List steps from one
	// scope to the next through its index and looks the key up in each,
	// at a cost of the number of scopes, not of keys (about a second for
	// 10,000 scopes on the test machine). Defaults to "", every key.
	Key string
	// After continues a listing where the page before stopped: its
	// ListPage.Next. Defaults to "", the beginning.
	After string
	// Limit is the most records a page holds. Defaults to 100; at most
	// 10,000.
	Limit int
	// Examine is the most rows a page looks at, matching or not (with a
	// Key and AnyScope, the most scopes it steps through), so that no call
	// reads much of a large table when a filter matches few records: the
	// page then ends early, with Next set to go on. Defaults
	// to 10,000: on the test machine, with 10 million keys of random UUIDs,
	// 0.25 s when the rows are in PostgreSQL's cache and up to 2 s when
	// they are read from disk (each row is a page of its own in key
	// order; time-ordered keys, which the client interceptor sends, are
	// read faster).
	Examine int
}

// withDefaults fills in the defaults and checks f.
func (f *ListFilter) withDefaults() error {
	switch f.State {
	case "", "succeeded", "failed", "running":
	default:
		return fmt.Errorf("idempotency: ListFilter.State: %q is not a state; use succeeded, failed or running", f.State)
	}
	if f.NewerThan < 0 || f.OlderThan < 0 {
		return fmt.Errorf("idempotency: ListFilter: NewerThan and OlderThan are ages and cannot be negative, got %v and %v", f.NewerThan, f.OlderThan)
	}
	if f.Limit == 0 {
		f.Limit = 100
	}
	if f.Limit < 0 || f.Limit > 10000 {
		return fmt.Errorf("idempotency: ListFilter.Limit: %d is not between 1 and 10000", f.Limit)
	}
	if f.Examine == 0 {
		f.Examine = 10000
	}
	if f.Examine < 0 {
		return fmt.Errorf("idempotency: ListFilter.Examine: %d is negative", f.Examine)
	}
	return nil
}

// listPosition is where a listing stopped: after the stored key key of
// scope, or, past, after every key of scope (a listing of one key stops
// between two scopes).
type listPosition struct {
	scope, key string
	past       bool
}

// pastScope is the key of an encoded position past its scope: no key
// holds a NUL byte.
const pastScope = "\x00"

// after decodes f.After: the position after which to read.
func (f *ListFilter) after() (listPosition, error) {
	if f.After == "" { // an empty key comes before every key
		if f.AnyScope {
			return listPosition{}, nil
		}
		return listPosition{scope: f.Scope}, nil
	}
	b, err := base64.RawURLEncoding.DecodeString(f.After)
	var pos listPosition
	if err == nil {
		var ok bool
		if pos.scope, pos.key, ok = strings.Cut(string(b), "\x00"); !ok {
			err = errors.New("no separator")
		}
		if pos.key == pastScope {
			pos.key, pos.past = "", true
		}
	}
	if err != nil {
		return pos, fmt.Errorf("idempotency: ListFilter.After: %q is not a ListPage.Next", f.After)
	}
	if !f.AnyScope && pos.scope != f.Scope {
		return pos, fmt.Errorf("idempotency: ListFilter.After: the page it continues listed scope %q, not %q", pos.scope, f.Scope)
	}
	if pos.past && f.Key == "" {
		return pos, errors.New("idempotency: ListFilter.After: the page it continues listed the records of one key (ListFilter.Key); give it the same Key")
	}
	return pos, nil
}

// next is a ListPage.Next: the position encoded, as text (so never a NUL
// byte but the separator and pastScope).
func (p listPosition) next() string {
	key := p.key
	if p.past {
		key = pastScope
	}
	return base64.RawURLEncoding.EncodeToString([]byte(p.scope + "\x00" + key))
}

// ListPage is one page of [Store.List].
type ListPage struct {
	// Records are the records that matched, in the table's primary-key
	// order: by scope, then by key as stored (a transport's namespace
	// before the key, "http " or "message ", as for Inspect).
	Records []Record
	// Examined is how many rows the page looked at (with a Key and
	// AnyScope, how many scopes).
	Examined int
	// Next is where the page stopped, for ListFilter.After, or "" when
	// the listing is complete. Set when the page is full (Limit) and when
	// it looked at Examine rows.
	Next string
}

// listPageRows is how many rows one statement of List reads: each
// statement is short, and a List that has its records stops reading.
const listPageRows = 1000

// List returns a page of the records that match f, for operators: the
// keys of a scope, its failures, those of a method or of the last hour.
// It walks the table's primary key (scope, then key) from f.After, a
// thousand rows a statement, and applies the filters to the rows it
// reads: its cost is the rows it examines, never the table's size, and at
// most f.Examine of them. With a scope, it reads only that scope's keys.
// A call in progress has no committed row yet, and is not listed. Each
// statement reads the table as it is then: a key written or deleted while
// a listing goes on may or may not be in it.
func (s *Store) List(ctx context.Context, f ListFilter) (ListPage, error) {
	if err := f.withDefaults(); err != nil {
		return ListPage{}, err
	}
	pos, err := f.after()
	if err != nil {
		return ListPage{}, err
	}
	st, err := s.statements(ctx)
	if err != nil {
		return ListPage{}, s.dbError(ctx, "list keys", err)
	}
	var columns []string
	for _, c := range recordColumns {
		columns = append(columns, "CASE WHEN w.match THEN "+c+" END")
	}
	l := lister{s: s, f: f, table: st.table, columns: strings.Join(columns, ", "), filters: listFilters(f)}
	if f.Key != "" {
		return l.key(ctx, pos)
	}
	return l.rows(ctx, pos)
}

// lister is one call of List.
type lister struct {
	s       *Store
	f       ListFilter
	table   string
	columns string // a row's record, NULL where the row does not match
	filters []any  // the arguments of listMatch
}

// listMatch is whether a row of the table aliased w matches the filters,
// parameters $4 to $8 (NULL: any).
const listMatch = `($4::text IS NULL OR w.method = $4::text) AND ($5::text IS NULL OR pg_catalog.starts_with(w.method, $5::text))
  AND ($6::text IS NULL OR w.state = $6::text)
  AND ($7::bigint IS NULL OR w.created_at > pg_catalog.now() - $7::bigint * interval '1 microsecond')
  AND ($8::bigint IS NULL OR w.created_at <= pg_catalog.now() - $8::bigint * interval '1 microsecond')`

// listFilters are the arguments of listMatch for f.
func listFilters(f ListFilter) []any {
	var exact, prefix, state *string
	if m, ok := strings.CutSuffix(f.Method, "*"); ok {
		prefix = &m
	} else if f.Method != "" {
		exact = &f.Method
	}
	if f.State != "" {
		state = &f.State
	}
	micros := func(d time.Duration) *int64 {
		if d <= 0 {
			return nil
		}
		m := d.Microseconds()
		return &m
	}
	return []any{exact, prefix, state, micros(f.NewerThan), micros(f.OlderThan)}
}

// add adds the record of a row that matched to page.
func (l *lister) add(page *ListPage, raw *rawRecord, scope, key string) error {
	rec, err := raw.record(scope)
	if err != nil {
		return fmt.Errorf("idempotency: list keys: the record of key %q of scope %q: %w", key, scope, err)
	}
	page.Records = append(page.Records, rec)
	return nil
}

// rows lists the table's rows after pos, a thousand a statement.
func (l *lister) rows(ctx context.Context, pos listPosition) (ListPage, error) {
	var page ListPage
	f := l.f
	// Each row comes with whether it matches; the record's columns only
	// when it does. Parameters: the position after which to read, how many
	// rows, then the filters.
	rangeCond, order := `(w.scope, w.key) > ($1::text, $2::text)`, "w.scope, w.key"
	if !f.AnyScope {
		rangeCond, order = `w.scope = $1::text AND w.key > $2::text`, "w.key"
	}
	q := `SELECT w.scope, w.key, w.match, ` + l.columns + `
FROM (SELECT w.*, ` + listMatch + ` AS match
  FROM ` + l.table + ` w WHERE ` + rangeCond + ` ORDER BY ` + order + ` LIMIT $3::int) w
ORDER BY ` + order
	for page.Examined < f.Examine && len(page.Records) < f.Limit {
		n := min(listPageRows, f.Examine-page.Examined)
		var read int
		var full bool
		var decodeErr error
		err := l.s.readCommitted(ctx, func(tx pgx.Tx) error {
			rows, err := tx.Query(ctx, q, append([]any{pos.scope, pos.key, n}, l.filters...)...)
			if err != nil {
				return err
			}
			defer rows.Close()
			for rows.Next() {
				if full = len(page.Records) == f.Limit; full {
					return nil // the rest is the next page's
				}
				var scope, key string
				var match bool
				var raw rawRecord
				if err := rows.Scan(append([]any{&scope, &key, &match}, raw.targets()...)...); err != nil {
					return err
				}
				read++
				pos = listPosition{scope: scope, key: key}
				if match {
					if decodeErr = l.add(&page, &raw, scope, key); decodeErr != nil {
						return decodeErr
					}
				}
			}
			return rows.Err()
		})
		page.Examined += read
		if decodeErr != nil {
			return ListPage{}, decodeErr
		}
		if err != nil {
			return ListPage{}, l.s.dbError(ctx, "list keys", err)
		}
		if !full && read < n {
			return page, nil // the end of the table, or of the scope
		}
	}
	page.Next = pos.next()
	return page, nil
}

// key lists the records of f.Key after pos: with AnyScope by a loose index
// scan, each scope the smallest one after the last, a thousand scopes a
// statement, the key looked up in each (a scope that holds none is a row
// whose key is NULL); else in f.Scope alone.
func (l *lister) key(ctx context.Context, pos listPosition) (ListPage, error) {
	var page ListPage
	f := l.f
	if !f.AnyScope && pos.past {
		return page, nil // the scope's listing is over
	}
	// Parameters: the position after which to read, how many scopes, the
	// filters, then the stored keys f.Key names.
	query := func(first string) string {
		scopes := `SELECT $1::text, 1 WHERE $3::int > 0`
		if f.AnyScope {
			scopes = `(SELECT w.scope, 1 FROM ` + l.table + ` w WHERE ` + first + ` ORDER BY w.scope LIMIT 1)
  UNION ALL
  SELECT (SELECT w.scope FROM ` + l.table + ` w WHERE w.scope > s.scope ORDER BY w.scope LIMIT 1), s.n + 1
  FROM s WHERE s.scope IS NOT NULL AND s.n < $3::int`
		}
		return `WITH RECURSIVE s(scope, n) AS (` + scopes + `)
SELECT s.n, s.scope, w.key, w.match, ` + l.columns + `
FROM s LEFT JOIN LATERAL (SELECT w.*, ` + listMatch + ` AS match
  FROM ` + l.table + ` w WHERE w.scope = s.scope AND w.key = ANY($9::text[]) AND (w.scope <> $1::text OR w.key > $2::text)) w ON true
WHERE s.scope IS NOT NULL ORDER BY s.n, w.key`
	}
	within, after := query(`w.scope >= $1::text`), query(`w.scope > $1::text`)
	keys := storedKeys(f.Key)
	for page.Examined < f.Examine && len(page.Records) < f.Limit {
		n := min(listPageRows, f.Examine-page.Examined)
		q := within
		if pos.past {
			q = after
		}
		var stepped, last int
		var full bool
		var decodeErr error
		err := l.s.readCommitted(ctx, func(tx pgx.Tx) error {
			rows, err := tx.Query(ctx, q, append(append([]any{pos.scope, pos.key, n}, l.filters...), keys)...)
			if err != nil {
				return err
			}
			defer rows.Close()
			for rows.Next() {
				if full = len(page.Records) == f.Limit; full {
					return nil // the rest is the next page's
				}
				var step int
				var scope string
				var key *string
				var match *bool
				var raw rawRecord
				if err := rows.Scan(append([]any{&step, &scope, &key, &match}, raw.targets()...)...); err != nil {
					return err
				}
				if step != last {
					stepped, last = stepped+1, step
				}
				if key == nil { // the scope holds no record of the key
					pos = listPosition{scope: scope, past: true}
					continue
				}
				pos = listPosition{scope: scope, key: *key}
				if match != nil && *match {
					if decodeErr = l.add(&page, &raw, scope, *key); decodeErr != nil {
						return decodeErr
					}
				}
			}
			return rows.Err()
		})
		page.Examined += stepped
		if decodeErr != nil {
			return ListPage{}, decodeErr
		}
		if err != nil {
			return ListPage{}, l.s.dbError(ctx, "list keys", err)
		}
		if full {
			break
		}
		if !f.AnyScope || stepped < n {
			return page, nil // the scope, or the table, has no more
		}
		pos = listPosition{scope: pos.scope, past: true} // every row of its last scope was read
	}
	page.Next = pos.next()
	return page, nil
}

// Forget deletes the record of one key, so that the next call with it runs
// again. It deletes the record [Store.Inspect] shows: name a transport's
// key with its namespace, as for Inspect. The records of the steps its
// call ran ([Step]) go with it, so that they run again too (with the same
// keys: a provider that still has a key answers as it did).
//
// With state "", whatever the record holds: for an operator who knows the
// stored result must not be replayed (a customer's charge that was
// refunded by hand, say). With state "failed", only a record whose call
// failed for good (State "failed": a [Final] error, a message given up),
// so that the next call with the key runs again once its cause is fixed (a
// redrive): a record in another state is kept, in the same statement that
// would delete it, and Forget returns [ErrNotFailed], so that a redrive
// repeated, or racing the call it redrives, never forgets an effect that
// was applied. Any other state is refused.
//
// It refuses, with [ErrInProgress], while a call holds the key (in any of
// the transports it may name), and returns [ErrKeyNotFound] when there is
// no record.
func (s *Store) Forget(ctx context.Context, scope, key, state string) error {
	switch state {
	case "":
		return s.forget(ctx, scope, key, false)
	case "failed":
		return s.forget(ctx, scope, key, true)
	}
	return fmt.Errorf("idempotency: Forget: state %q: use \"failed\", or \"\" for any", state)
}

// ErrNotFailed is returned by [Store.Forget], asked to forget a failure,
// for a key whose record is not one: its call succeeded (or its handler
// committed its own transaction), and its effect must not be applied
// again.
var ErrNotFailed = errors.New("idempotency: the key's call did not fail; its record is kept")

func (s *Store) forget(ctx context.Context, scope, key string, onlyFailed bool) error {
	st, err := s.statements(ctx)
	if err != nil {
		return s.dbError(ctx, "forget key", err)
	}
	keys := storedKeys(key)
	err = s.readCommitted(ctx, func(tx pgx.Tx) error {
		var free bool
		if err := tx.QueryRow(ctx, st.lockForget, scope, keys).Scan(&free); err != nil {
			return err
		}
		if !free {
			return inProgress("a call holds the key; forget it once the call is over", s.opts.retryDelay)
		}
		if onlyFailed {
			var state string
			switch err := tx.QueryRow(ctx, st.forgetFailed, scope, keys).Scan(&state); {
			case errors.Is(err, pgx.ErrNoRows):
				return ErrKeyNotFound
			case err != nil:
				return err
			case state != "failed":
				return fmt.Errorf("%w (state %s)", ErrNotFailed, state)
			}
			_, err := tx.Exec(ctx, st.forgetSteps, scope, keys)
			return err
		}
		tag, err := tx.Exec(ctx, st.forget, scope, keys)
		if err == nil && tag.RowsAffected() == 0 {
			err = ErrKeyNotFound
		}
		if err == nil {
			_, err = tx.Exec(ctx, st.forgetSteps, scope, keys)
		}
		return err
	})
	if err != nil && !errors.Is(err, ErrKeyNotFound) && !errors.Is(err, ErrInProgress) && !errors.Is(err, ErrNotFailed) {
		err = s.dbError(ctx, "forget key", err)
	}
	return err
}

// readCommitted runs fn in a READ COMMITTED transaction of its own, so that
// the engine's reads of the key table never count in SERIALIZABLE's
// conflict tracking, whatever the database's default. fn's error rolls it
// back.
func (s *Store) readCommitted(ctx context.Context, fn func(tx pgx.Tx) error) error {
	pc, err := s.db.Acquire(ctx)
	if err != nil {
		return err
	}
	defer pc.Release()
	return pgx.BeginTxFunc(ctx, pc.Conn(), pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, fn)
}
