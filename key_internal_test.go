package idempotency

import (
	"errors"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func TestUnitValidateKey(t *testing.T) {
	t.Parallel()
	for key, reason := range map[string]string{
		"":                       "key is empty",
		strings.Repeat("a", 256): "256 bytes long, the limit is 255",
		"has space":              "byte 3 is 0x20",
		"a\tb":                   "byte 1 is 0x09",
		"a\x00b":                 "byte 1 is 0x00",
		"a\x7fb":                 "byte 1 is 0x7F",
		"ключ":                   `non-ASCII 'к'`,
		"\xff":                   "byte 0 is 0xFF",
	} {
		err := ValidateKey(key)
		require.ErrorIs(t, err, ErrInvalidKey, "%q", key)
		require.ErrorContains(t, err, reason, "%q", key)
		require.Equal(t, codes.InvalidArgument, status.Code(err))
	}
	for _, key := range []string{"!", "~", strings.Repeat("~", MaxKeyLen), "0190f3b4-7c1e-7000-8000-000000000000"} {
		require.NoError(t, ValidateKey(key), "%q", key)
	}
}

// The engine's key errors name no transport; each transport says where the
// key came from.
func TestUnitKeyErrorsNameTheirSource(t *testing.T) {
	t.Parallel()
	bare := ValidateKey("")
	require.Empty(t, badRequestField(bare), "the engine names no field")

	header := keyError(bare, MetadataKey, "")
	require.Equal(t, MetadataKey, badRequestField(header))
	require.ErrorIs(t, header, ErrInvalidKey)

	msg := keyError(bare, "ID", "message ID")
	require.Equal(t, "ID", badRequestField(msg))
	require.ErrorContains(t, msg, "message ID: key is empty")
	require.NotContains(t, msg.Error(), MetadataKey)
	require.Empty(t, badRequestField(bare), "labelling copies, the original is unchanged")

	other := errors.New("not a key error")
	require.Equal(t, other, keyError(other, "f", "w"))
}

func badRequestField(err error) string {
	for _, d := range status.Convert(err).Details() {
		if br, ok := d.(*errdetails.BadRequest); ok {
			return br.GetFieldViolations()[0].GetField()
		}
	}
	return ""
}
