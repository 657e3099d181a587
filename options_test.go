package idempotency

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
)

// One rule for every option: an invalid value makes NewStore return an
// error and the interceptor constructors panic, each naming the option.
func TestUnitInvalidOptionsNameThemselves(t *testing.T) {
	t.Parallel()
	var pool *pgxpool.Pool // NewStore does not touch the database
	for name, opt := range map[string]StoreOption{
		"WithTable":               WithTable("", ""),
		"WithTable ":              WithTable("", strings.Repeat("t", 64)),
		"WithTable  ":             WithTable("a\x00b", "t"),
		"WithTable   ":            WithTable("", strings.Repeat("t", 49)), // fits alone, not with "_expires_at_idx"
		"WithInProgressWait":      WithInProgressWait(0),
		"WithSuggestedRetryDelay": WithSuggestedRetryDelay(-time.Second),
		"WithFinishTimeout":       WithFinishTimeout(0),
		"WithIsolation":           WithIsolation("snapshot"),
	} {
		_, err := NewStore(pool, opt)
		require.ErrorContains(t, err, strings.TrimSpace(name))
	}
	_, err := NewStore(nil)
	require.ErrorContains(t, err, "db is nil")
	store, err := NewStore(pool)
	require.NoError(t, err)
	_, err = NewStore(pool, WithTable("", strings.Repeat("t", 48)))
	require.NoError(t, err, "48 bytes leave room for both suffixes")
	_, err = NewStore(pool, WithTable("", strings.Repeat("t", 53)))
	require.ErrorContains(t, err, "at most 48 bytes", "the limit the longer suffix sets, whichever check fails")

	for name, opt := range map[string]ServerOption{
		"WithScope":       WithScope(nil),
		"WithTTL":         WithTTL(0),
		"WithFinalCodes":  WithFinalCodes(codes.NotFound, codes.OK),
		"WithFinalCodes ": WithFinalCodes(codes.Code(17)),
	} {
		require.PanicsWithValue(t, panicMessage(t, func() { UnaryServerInterceptor(store, opt) }), func() { UnaryServerInterceptor(store, opt) })
		require.Contains(t, panicMessage(t, func() { UnaryServerInterceptor(store, opt) }), strings.TrimSpace(name))
	}
	require.Contains(t, panicMessage(t, func() { UnaryServerInterceptor(nil) }), "store is nil")

	for name, opt := range map[string]ClientOption{
		"WithRetryBackoff":      WithRetryBackoff(0, time.Second),
		"WithRetryBackoff ":     WithRetryBackoff(time.Second, time.Millisecond),
		"WithPerAttemptTimeout": WithPerAttemptTimeout(-time.Second),
		"WithMaxAttempts":       WithMaxAttempts(0),
		"WithRetryBudget":       WithRetryBudget(0),
	} {
		require.Contains(t, panicMessage(t, func() { UnaryClientInterceptor(opt) }), strings.TrimSpace(name))
	}

	for name, opt := range map[string]HTTPOption{
		"WithHTTPReplayedHeaders":  WithHTTPReplayedHeaders("set-cookie"),
		"WithHTTPReplayedHeaders ": WithHTTPReplayedHeaders("X-Request-Id", "Authorization"),
		"WithHTTPIsolation":        WithHTTPIsolation("snapshot"),
	} {
		require.Contains(t, panicMessage(t, func() { HTTPMiddleware(store, opt) }), strings.TrimSpace(name))
	}

	// Valid edge values are accepted.
	UnaryServerInterceptor(store, WithFinalCodes(), WithScope(func(context.Context) (string, error) { return "", nil }))
	UnaryClientInterceptor(WithMaxAttempts(1), WithRetryBudget(time.Nanosecond), WithPerAttemptTimeout(0), WithRetryBackoff(time.Millisecond, time.Millisecond))
}

func panicMessage(t *testing.T, f func()) (msg string) {
	t.Helper()
	defer func() {
		r := recover()
		require.NotNil(t, r, "expected a panic")
		msg, _ = r.(string)
	}()
	f()
	return ""
}

// Exported defaults are copies: changing them changes nothing.
func TestUnitDefaultsAreCopies(t *testing.T) {
	t.Parallel()
	DefaultFinalCodes()[0] = codes.Unavailable
	require.Equal(t, codes.NotFound, DefaultFinalCodes()[0])
	require.False(t, defaultServerOptions().final[codes.Unavailable])
}
