package idempotency

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc/codes"
)

// DefaultTTL is how long a finished key is kept when a call sets no TTL.
const DefaultTTL = 24 * time.Hour

// DefaultTable is the name of the key table when [WithTable] is not used.
const DefaultTable = "idempotency_keys"

// DB is what a [Store] needs from PostgreSQL: a connection per call, and
// plain statements and transactions for cleanup and inspection. In
// practice only a *pgxpool.Pool fits, since Acquire returns a
// *pgxpool.Conn; pass one (a wrapper around a pool, for instrumentation,
// fits too). Every call that runs holds one of its connections for the
// length of its transaction, and a duplicate waiting for it holds none.
type DB interface {
	Acquire(ctx context.Context) (*pgxpool.Conn, error)
	Begin(ctx context.Context) (pgx.Tx, error)
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Store keeps idempotency keys and their results in a PostgreSQL table and
// runs calls at most once per key ([Store.Execute]). It is safe for
// concurrent use, by any number of processes sharing the database.
type Store struct {
	db    DB
	ident pgx.Identifier
	opts  storeOptions

	// stmts holds the statements, rendered for the table once its schema
	// is known; see statements.
	stmts     atomic.Pointer[statements]
	resolveMu sync.Mutex
	// defaultSnapshot: the database's default isolation level, as the
	// store's first call and the last claim at it saw it, is REPEATABLE
	// READ or SERIALIZABLE.
	defaultSnapshot atomic.Bool
	// simpleProtocol: the pool's query mode is the simple protocol, which
	// sends a batch as one string (see callTx.sendBatch).
	simpleProtocol atomic.Bool
	// pooled: the store's connections reach PostgreSQL through a
	// connection pooler (see renderStatements and finish).
	pooled atomic.Bool
	// config is what callTx.Config returns, made at its first use.
	config atomic.Pointer[pgxpool.Config]
}

// poolConfig is the configuration of the store's pool: the pool's own when
// db has one (a *pgxpool.Pool), else one around conn's settings.
func (s *Store) poolConfig(conn *pgx.Conn) *pgxpool.Config {
	if c := s.config.Load(); c != nil {
		return c
	}
	var c *pgxpool.Config
	if p, ok := s.db.(interface{ Config() *pgxpool.Config }); ok {
		c = p.Config()
	}
	if c == nil {
		c = &pgxpool.Config{ConnConfig: conn.Config()}
	}
	s.config.CompareAndSwap(nil, c)
	return s.config.Load()
}

// NewStore returns a Store on db. The table must exist: run [Store.Migrate]
// once at startup, or apply [Migrations] with your own tool. An
// invalid option is reported as an error naming it.
func NewStore(db DB, opts ...StoreOption) (*Store, error) {
	if db == nil {
		return nil, errors.New("idempotency: NewStore: db is nil")
	}
	o, err := newStoreOptions(opts)
	if err != nil {
		return nil, err
	}
	return &Store{db: db, ident: o.ident(), opts: o}, nil
}

// newStoreOptions applies opts to the defaults and validates the result.
func newStoreOptions(opts []StoreOption) (storeOptions, error) {
	o := defaultStoreOptions()
	for _, opt := range opts {
		opt(&o)
	}
	return o, o.validate()
}

// ident names the key table, with its schema when one is configured.
func (o *storeOptions) ident() pgx.Identifier {
	if o.schema != "" {
		return pgx.Identifier{o.schema, o.table}
	}
	return pgx.Identifier{o.table}
}

// statements returns the store's statements, rendered at the store's
// first call. A table configured without a schema is found in the schemas
// of the connection's search_path, once; from then on every statement
// names it with its schema, so that a handler's SET LOCAL search_path (a
// tenant's schema) cannot move the key's row into another table. If the
// table is later dropped, the next call looks for it again. The same first
// call checks that the pool's query mode works where it runs (see
// checkQueryMode).
func (s *Store) statements(ctx context.Context) (*statements, error) {
	if st := s.stmts.Load(); st != nil {
		return st, nil
	}
	s.resolveMu.Lock()
	defer s.resolveMu.Unlock()
	if st := s.stmts.Load(); st != nil {
		return st, nil
	}
	pc, err := s.db.Acquire(ctx)
	if err != nil {
		return nil, err
	}
	defer pc.Release()
	var schema *string
	var backendPID uint32
	var defaultLevel string
	// In the simple protocol: it works in front of any pooler, whatever the
	// pool's query mode, which is what is checked next.
	err = pc.QueryRow(ctx, `SELECT (SELECT n.nspname FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE c.oid = pg_catalog.to_regclass($1)), pg_catalog.pg_backend_pid(), pg_catalog.current_setting('default_transaction_isolation')`,
		pgx.QueryExecModeSimpleProtocol, s.ident.Sanitize()).Scan(&schema, &backendPID, &defaultLevel)
	if err != nil {
		return nil, err
	}
	if err := checkQueryMode(pc.Conn(), backendPID); err != nil {
		return nil, err
	}
	// A pooler hands out process IDs of its own for cancel requests.
	pooled := pc.Conn().PgConn().PID() != backendPID
	s.pooled.Store(pooled)
	s.defaultSnapshot.Store(defaultLevel == "repeatable read" || defaultLevel == "serializable")
	s.simpleProtocol.Store(pc.Conn().Config().DefaultQueryExecMode == pgx.QueryExecModeSimpleProtocol)
	if schema == nil {
		return nil, &pgconn.PgError{Severity: "ERROR", Code: sqlUndefinedTable, Message: fmt.Sprintf("relation %s does not exist", s.ident.Sanitize())}
	}
	st := renderStatements(pgx.Identifier{*schema, s.opts.table}.Sanitize(), pooled)
	s.stmts.Store(&st)
	return &st, nil
}

// checkQueryMode refuses pgx's describe_exec query mode behind a
// connection pooler. That mode prepares an unnamed statement in one round
// trip and binds it in the next, and a pooler in transaction mode may run
// the two on different server connections: the bind then fails, or runs
// another client's statement. A pooler is recognised by the process ID it
// hands out for cancel requests, which is not the server process's own.
// (cache_statement, pgx's default, prepares named statements: behind a
// pooler it needs one that carries them, PgBouncer 1.21 or later with
// max_prepared_statements; without, calls fail with the message of
// sqlInvalidStatementName.)
func checkQueryMode(conn *pgx.Conn, backendPID uint32) error {
	if conn.Config().DefaultQueryExecMode != pgx.QueryExecModeDescribeExec || conn.PgConn().PID() == backendPID {
		return nil
	}
	return &dbFailure{code: codes.Internal, op: "check the pool's query mode",
		msg: "the pool uses pgx's default_query_exec_mode=describe_exec behind a connection pooler, where it can bind one client's statement to another's; " +
			"use cache_describe or exec (or cache_statement in session pooling, or with PgBouncer 1.21 or later and max_prepared_statements)"}
}

// forgetTable makes the next call look for a table configured without a
// schema again: it was not where it was found.
func (s *Store) forgetTable() {
	s.stmts.Store(nil)
}

// StoreOption configures a [Store]. Invalid values make [NewStore] return
// an error.
type StoreOption func(*storeOptions)

// storeOptions, like the options of every constructor, start from their
// defaults (defaultStoreOptions); each option sets a field, or records an
// error when what it was given cannot be kept as it is, and validate checks
// the result once, naming the option at fault.
type storeOptions struct {
	schema, table  string
	inProgressWait time.Duration
	retryDelay     time.Duration
	finishTimeout  time.Duration
	isolation      pgx.TxIsoLevel
	tracer         Tracer
	// derivedKeyNamespace and derivedKeyVersion: see WithDerivedKeyNamespace
	// and WithDerivedKeyVersion.
	derivedKeyNamespace string
	derivedKeyVersion   int
	// noSQLCheck turns off the refusal of transaction control in a
	// handler's SQL, for the tests that prove the key does not depend on
	// it (export_test.go).
	noSQLCheck bool
	err        error // the first invalid option that cannot wait for validate
}

func defaultStoreOptions() storeOptions {
	return storeOptions{
		table:          DefaultTable,
		inProgressWait: 2 * time.Second,
		retryDelay:     500 * time.Millisecond,
		finishTimeout:  10 * time.Second,
		// The newest; 1 only while a deploy upgrades from a release that
		// derived keys the first way.
		derivedKeyVersion: defaultDerivedKeyVersion,
	}
}

func (o storeOptions) validate() error {
	if o.err != nil {
		return o.err
	}
	for name, v := range map[string]string{"schema": o.schema, "table": o.table} {
		if len(v) > 63 {
			return fmt.Errorf("idempotency: WithTable: %s name %q is longer than PostgreSQL's 63-byte identifier limit", name, v)
		}
		for i := 0; i < len(v); i++ {
			if v[i] == 0 {
				return fmt.Errorf("idempotency: WithTable: %s name contains a NUL byte", name)
			}
		}
	}
	// Migrate names two more objects after the table; they must fit too,
	// the longer suffix deciding.
	suffix := migrationsSuffix
	if len(expiresIndexSuffix) > len(suffix) {
		suffix = expiresIndexSuffix
	}
	if n := len(o.table) + len(suffix); n > 63 {
		return fmt.Errorf("idempotency: WithTable: table name %q is %d bytes; with the suffix %q of the objects Migrate creates beside it, it must fit PostgreSQL's 63-byte identifier limit, so at most %d bytes",
			o.table, len(o.table), suffix, 63-len(suffix))
	}
	switch {
	case o.table == "":
		return errors.New("idempotency: WithTable: table name is empty")
	case o.inProgressWait < time.Millisecond:
		return fmt.Errorf("idempotency: WithInProgressWait: must be at least 1ms, got %v", o.inProgressWait)
	case o.retryDelay < 0:
		return fmt.Errorf("idempotency: WithSuggestedRetryDelay: must not be negative, got %v", o.retryDelay)
	case o.finishTimeout <= 0:
		return fmt.Errorf("idempotency: WithFinishTimeout: must be positive, got %v", o.finishTimeout)
	case o.derivedKeyVersion < 1 || o.derivedKeyVersion > 3:
		return fmt.Errorf("idempotency: WithDerivedKeyVersion: %d is not a version of the derivation (1, 2 or 3)", o.derivedKeyVersion)
	case !utf8.ValidString(o.derivedKeyNamespace):
		return errors.New("idempotency: WithDerivedKeyNamespace: the namespace is not valid UTF-8")
	}
	if _, ok := beginStatements[o.isolation]; !ok {
		return fmt.Errorf("idempotency: WithIsolation: %q is not an isolation level of pgx.TxIsoLevel", o.isolation)
	}
	return nil
}

// WithIsolation sets the isolation level of every call's transaction,
// where the call sets none (Call.Isolation, a method's proto option, an
// HTTP middleware's WithHTTPIsolation). Handlers cannot raise it
// themselves: SET TRANSACTION fails after a transaction's first statement,
// and the engine refuses it. Every guarantee holds at every level, at the
// same cost; at REPEATABLE READ and SERIALIZABLE a serialization failure of
// the handler's work is returned as codes.Aborted, to retry with the same
// key.
// Defaults to "", the database's default_transaction_isolation.
func WithIsolation(level pgx.TxIsoLevel) StoreOption {
	return func(o *storeOptions) { o.isolation = level }
}

// WithDerivedKeyNamespace names the store for the keys its calls derive for
// downstream calls ([EffectKey], [CountedKey]), beside its table. Set
// it when two services (or two deployments of one) that may receive the
// same client key and serve the same method share a key table name, so
// that a downstream system they both call (one payment provider, one
// merchant account) never sees their keys as one operation's. Changing it
// changes every derived key: a call that crashed before the change and
// runs again after it sends new keys. Defaults to "".
func WithDerivedKeyNamespace(namespace string) StoreOption {
	return func(o *storeOptions) { o.derivedKeyNamespace = namespace }
}

// defaultDerivedKeyVersion is the version of the derivation of derived
// keys (see WithDerivedKeyVersion) a store uses unless told otherwise.
const defaultDerivedKeyVersion = 3

// WithDerivedKeyVersion chooses how derived keys are made. Version 3, the
// default, derives from the whole operation, its request as the request
// comparison sees it (see [EffectKey]). Version 2, that of the release before, derives also from
// what the comparison does not tell apart: an HTTP request's keys from its
// whole fingerprint, which for a JSON body or a form the middleware read
// holds the digest of the body's bytes; a proto request's from its
// encoding with -0 and 0, a field with presence set to its default and
// unset, and an Any's type URL prefix told apart. A retry that the
// comparison calls the same request but that is written another way (JSON
// members in another order, a form parsed in front on one attempt only)
// derives other keys under version 2. Versions 2 and 3 derive the same
// keys for every message, for every proto request written one way already
// (no float of -0 or NaN, no field set to its default, Any URLs under
// type.googleapis.com/), and for every HTTP request whose body is compared
// by its bytes or is a form parsed in front (unless it names its charset
// in upper case). Version 1, that of the releases before 2, derives from
// the scope, the key, the target and the ordinal only, which gives two
// operations under one client key the same downstream keys. A call whose
// first run sent keys of one version and that runs again under another
// (its process died before the commit, or its key was released, across
// the deploy) sends other keys than the first run did, and a downstream
// system charges it again: upgrade with the version of the release before
// (WithDerivedKeyVersion(2), or 1), and drop it in a later deploy, once no
// call of the old release can be run again (its clients have stopped
// retrying it). Under version 1, only [CountedKey] derives version 1
// keys; named effects, which version 1 did not have, derive version 2
// keys.
func WithDerivedKeyVersion(version int) StoreOption {
	return func(o *storeOptions) { o.derivedKeyVersion = version }
}

// WithTable sets the key table. An empty schema means the table is looked
// for in the connection's search_path once, at the store's first call, and
// then named with the schema it was found in: a store has one table, even
// for handlers that switch search_path per tenant (give each tenant its
// own Store, with its schema, for a key table per tenant). Names are quoted
// as identifiers, so any name is safe. Defaults to "idempotency_keys" with
// no schema.
func WithTable(schema, table string) StoreOption {
	return func(o *storeOptions) { o.schema, o.table = schema, table }
}

// WithInProgressWait bounds how long a duplicate waits for a call holding the
// same key before it gets [ErrInProgress]. A waiting duplicate holds no
// database connection: it looks at the key now and then (every 2 ms at
// first, backing off to every 50 ms), each time on a connection borrowed
// for one statement. At least 1ms. Defaults to 2 seconds.
func WithInProgressWait(d time.Duration) StoreOption {
	return func(o *storeOptions) { o.inProgressWait = d }
}

// WithSuggestedRetryDelay sets the delay the server suggests to clients in
// the RetryInfo detail of every retryable status of the layer
// ([ErrInProgress], [ErrStoreUnavailable], the database's Aborted; HTTP:
// Retry-After, in whole seconds, at least 1), which [RetryDelay] reads on
// the client and the client interceptor waits at least. It is not the client's
// own backoff ([WithRetryBackoff]). Defaults to 500 milliseconds.
func WithSuggestedRetryDelay(d time.Duration) StoreOption {
	return func(o *storeOptions) { o.retryDelay = d }
}

// WithFinishTimeout bounds storing the result and committing once the call's
// work is done. It runs on a context detached from the caller's, so that a
// client that hung up still has its result stored. Defaults to 10 seconds.
func WithFinishTimeout(d time.Duration) StoreOption {
	return func(o *storeOptions) { o.finishTimeout = d }
}
