package idempotency_test

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

const (
	raceKeys   = 200
	racePerKey = 64
	// raceWave keys are raced at a time, so that the goroutines alive at
	// once (two per call: client and server) stay under the race
	// detector's limit of 8128.
	raceWave = 25
)

// 64 goroutines per key send the same logical call at once, through the
// client interceptor with retries, for 200 keys. Each key's handler runs
// exactly once, and all 64 callers end with byte-identical responses.
func TestConcurrentDuplicatesExecuteOnceAndAgreeByteForByte(t *testing.T) {
	t.Parallel()
	db := suiteDB(t)
	var mu sync.Mutex
	runs := map[string]int{} // key -> handler runs, committed or not
	srv := startReplica(t, schemaPool(t, db.Schema, 16, nil), replicaConfig{
		// Duplicates give up on the running call after 5ms with Aborted and
		// come back through the client's retries.
		storeOpts: []idempotency.StoreOption{idempotency.WithInProgressWait(5 * time.Millisecond), idempotency.WithSuggestedRetryDelay(5 * time.Millisecond)},
		handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
			key := metadata.ValueFromIncomingContext(ctx, idempotency.MetadataKey)[0]
			mu.Lock()
			runs[key]++
			mu.Unlock()
			resp, err := keyedLedger(ctx, req)
			time.Sleep(20 * time.Millisecond) // hold the key while the duplicates pile up
			return resp, err
		},
	})
	conn, attempts := retryingClient(t, "passthrough:///"+srv.addr, 20)

	keys := make([]string, raceKeys)
	for i := range keys {
		keys[i] = uuid.Must(uuid.NewV7()).String()
	}
	type answer struct {
		raw      []byte
		replayed bool
		err      error
	}
	answers := make([][racePerKey]answer, raceKeys)
	var retries atomic.Int64
	for wave := 0; wave < raceKeys; wave += raceWave {
		start := make(chan struct{})
		var wg sync.WaitGroup
		for k := wave; k < min(wave+raceWave, raceKeys); k++ {
			ctx := idempotency.WithOutgoingKey(context.Background(), keys[k])
			for g := range racePerKey {
				wg.Go(func() {
					<-start
					var trailer metadata.MD
					resp, err := charge(ctx, conn, k, grpc.Trailer(&trailer), retryCounter(&retries))
					a := answer{err: err, replayed: len(trailer.Get(idempotency.ReplayedTrailer)) > 0}
					if err == nil {
						a.raw, _ = proto.Marshal(resp)
					}
					answers[k][g] = a
				})
			}
		}
		close(start)
		wg.Wait()
	}

	replays := 0
	for k, key := range keys {
		require.Equal(t, 1, runs[key], "handler runs for key %d", k)
		executed := 0
		for g, a := range answers[k] {
			require.NoError(t, a.err, "key %d, goroutine %d", k, g)
			require.True(t, bytes.Equal(answers[k][0].raw, a.raw), "key %d: goroutine %d got %q, goroutine 0 got %q", k, g, a.raw, answers[k][0].raw)
			if a.replayed {
				replays++
			} else {
				executed++
			}
		}
		require.Equal(t, 1, executed, "key %d: exactly one caller gets the fresh response", k)
	}
	e := &env{t: t, db: db}
	require.Empty(t, e.exactlyOnce(raceKeys))
	require.EqualValues(t, raceKeys, srv.execs.Load(), "committed executions")
	requireKeysMatchLedger(t, db)
	attempts.requireOnlyFailures(t, codes.Aborted) // a duplicate that gave up waiting, and retried
	_, aborted := attempts.failures()
	require.NotEmpty(t, aborted, "some duplicates must have gone through the retries")
	failed, byCode := attempts.failures()
	t.Logf("races: %d keys x %d goroutines = %d calls, %d executions, %d replays, %d failed attempts (%s) retried %d times, 0 duplicates",
		raceKeys, racePerKey, raceKeys*racePerKey, srv.execs.Load(), replays, failed, byCode, retries.Load())
}

// A duplicate that reaches the database exactly while the first call
// commits must get the stored response on its first attempt, not an error:
// whichever side of the commit its reads and its claim fall on. The winner's
// commit is held until the duplicate's first or second statement starts,
// then released after a random few hundred microseconds, so that over the
// rounds the commit lands before, between and after the duplicate's
// statements.
func TestDuplicateArrivingAtCommitGetsReplay(t *testing.T) {
	t.Parallel()
	const rounds = 100
	db := suiteDB(t)
	gate := &commitGate{}
	pool := schemaPool(t, db.Schema, 4, func(c *pgxpool.Config) { c.ConnConfig.Tracer = &testdb.Tracer{OnRoundTrip: gate.roundTrip} })
	srv := startReplica(t, pool, replicaConfig{storeOpts: []idempotency.StoreOption{idempotency.WithInProgressWait(liveness)}})
	conn := dial(t, srv.addr) // no retries: the duplicate's first answer must be the replay

	rng := rand.New(rand.NewPCG(7, 7))
	statements := map[int64]int{} // duplicate's statements before its answer -> rounds
	for r := range rounds {
		round := &gateRound{
			commitStarting: make(chan struct{}),
			loserAtDB:      make(chan struct{}),
			holdUntil:      1 + int64(r%2),
			jitter:         time.Duration(rng.IntN(500)) * time.Microsecond,
		}
		gate.round.Store(round)
		key := uuid.Must(uuid.NewV7()).String()
		as := func(role string) context.Context {
			return metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey, key, "x-race-role", role)
		}
		winner := make(chan reply, 1)
		go func() { winner <- invoke(as("winner"), conn, methodCharge, body(r)) }()
		select {
		case <-round.commitStarting:
		case <-time.After(liveness):
			t.Fatalf("round %d: the first call never reached its commit", r)
		}
		loser := invoke(as("loser"), conn, methodCharge, body(r))
		first := <-winner
		require.NoError(t, first.err, "round %d: first call", r)
		require.NoError(t, loser.err, "round %d: a duplicate arriving at the commit must get the replay", r)
		require.True(t, loser.replayed, "round %d", r)
		require.Equal(t, first.raw, loser.raw, "round %d: replay differs from the response", r)
		require.False(t, round.timedOut.Load(), "round %d: the duplicate never reached the database", r)
		statements[round.loserStatements.Load()]++
	}
	e := &env{t: t, db: db}
	require.Empty(t, e.exactlyOnce(rounds))
	requireKeysMatchLedger(t, db)
	t.Logf("duplicates at the commit: %d rounds, 0 errors, 0 duplicate executions; database round trips of the duplicate -> rounds: %v", rounds, statements)
}

// commitGate is a pool's round-trip hook that holds the commit of the call marked
// "winner" until the call marked "loser" has started its holdUntil-th
// statement, then for jitter more.
type commitGate struct{ round atomic.Pointer[gateRound] }

type gateRound struct {
	commitStarting  chan struct{}
	loserAtDB       chan struct{}
	holdUntil       int64
	jitter          time.Duration
	loserStatements atomic.Int64
	timedOut        atomic.Bool
	once            sync.Once
}

func (g *commitGate) roundTrip(ctx context.Context, _ *pgx.Conn, statements []string) {
	commit := testdb.HasCommit(statements)
	r := g.round.Load()
	if r == nil {
		return
	}
	switch role := metadata.ValueFromIncomingContext(ctx, "x-race-role"); {
	case len(role) == 1 && role[0] == "loser":
		if r.loserStatements.Add(1) == r.holdUntil {
			close(r.loserAtDB)
		}
	case len(role) == 1 && role[0] == "winner" && commit:
		r.once.Do(func() {
			close(r.commitStarting)
			select {
			case <-r.loserAtDB:
			case <-time.After(30 * time.Second):
				r.timedOut.Store(true)
			}
			time.Sleep(r.jitter)
		})
	}
}

// A saturated pool (MaxConns 1 and 2) and 16+ callers of few keys, with
// handlers that misbehave in turn (tx.Conn() with a COMMIT, a panic, an
// error, an aborted statement ignored, rows left open): every key's callers
// agree on one answer, a key whose handler committed anything never runs
// again, nobody gets Unavailable, and no lock is left.
func TestSaturatedPoolsWithMisbehavingHandlers(t *testing.T) {
	t.Parallel()
	for _, conns := range []int32{1, 2} {
		t.Run(fmt.Sprintf("MaxConns=%d", conns), func(t *testing.T) {
			t.Parallel()
			db := testdb.New(t, conns)
			store := migratedStore(t, db, idempotency.WithInProgressWait(30*time.Second))
			createLedger(t, db)
			const keys = 6
			var runs [keys]atomic.Int64
			fn := func(k int) idempotency.Func {
				return func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
					n := runs[k].Add(1)
					if _, err := tx.Exec(ctx, `INSERT INTO ledger (note) VALUES ($1)`, fmt.Sprintf("k%d run %d", k, n)); err != nil {
						return nil, err
					}
					switch k {
					case 0:
						if _, err := tx.Conn().Exec(ctx, `COMMIT`); err != nil {
							return nil, err
						}
					case 1:
						if n == 1 {
							panic("boom")
						}
					case 2:
						if n == 1 {
							return nil, status.Error(codes.Unavailable, "provider down")
						}
					case 3:
						_, _ = tx.Exec(ctx, `SELECT 1/0`)
					case 4:
						rows, err := tx.Query(ctx, `SELECT generate_series(1, 100000)`)
						if err != nil {
							return nil, err
						}
						_ = rows // left open
					}
					return wrapperspb.String(fmt.Sprintf("k%d run %d", k, n)), nil
				}
			}
			type answer struct {
				code codes.Code
				msg  string
			}
			// call is one caller of key k and its answer; a handler's panic
			// that reaches the caller is recovered as the empty answer.
			call := func(k int) answer {
				var res idempotency.Result
				var err error
				func() {
					defer func() { _ = recover() }()
					res, err = store.Execute(context.Background(), idempotency.Call{Key: fmt.Sprintf("k%d", k), Method: "m"}, fn(k))
				}()
				a := answer{code: status.Code(err), msg: status.Convert(err).Message()}
				if err == nil && res.Response != nil {
					a.msg = res.Response.(*wrapperspb.StringValue).GetValue()
				}
				return a
			}
			answers := make([][]answer, keys)
			var mu sync.Mutex
			var wg sync.WaitGroup
			for c := range 18 {
				k := c % keys
				wg.Go(func() {
					a := call(k)
					mu.Lock()
					answers[k] = append(answers[k], a)
					mu.Unlock()
				})
			}
			wg.Wait()
			// Retries of the failed first runs (panic, Unavailable) then
			// settle those keys; everyone after agrees.
			for k := range keys {
				var last answer
				for range 2 {
					a := call(k)
					if last != (answer{}) {
						require.Equal(t, last, a, "key k%d: two later callers disagree", k)
					}
					last = a
				}
				t.Logf("k%d: runs %d, first callers %v, final %v", k, runs[k].Load(), answers[k], last)
				for _, a := range answers[k] {
					if a.msg != "provider down" { // the handler's own error
						require.NotEqual(t, codes.Unavailable, a.code, "k%d: %s", k, a.msg)
					}
				}
			}
			require.EqualValues(t, 1, runs[0].Load(), "committed on tx.Conn(): never again")
			require.EqualValues(t, 1, runs[3].Load(), "ignored failure: stored")
			require.EqualValues(t, 1, runs[4].Load(), "rows left open: stored")
			require.EqualValues(t, 1, runs[5].Load())
			keyNames := make([]string, keys)
			for k := range keys {
				keyNames[k] = fmt.Sprintf("k%d", k)
			}
			requireNoKeyLocks(t, db, "", keyNames, "a key's lock outlived its calls")
		})
	}
}
